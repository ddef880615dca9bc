"""The global candidate order shared by the prefix schedulers (dspark, dspark_async, sla).

A candidate is a draft slot (r, j): "verify draft token j of request r". Candidates are
ranked by prefix survival a[r, j] = c[r, 1] * ... * c[r, j], descending; ties go to the
smaller position j, then to the smaller request r. Because a[r, j] never increases with j
and ties prefer the smaller j, every prefix of this order verifies a prefix of each
request's block, and slot (r, j) is ranked using only c[r, 1..j] (plus other requests'
confidences). That second property is what keeps an early-stopping scan over this order
lossless: whether draft token j is verified never depends on c[r, j+1], which reads token j.

Slots with a = 0 are never candidates: verifying them costs a token of the pass and gains
nothing. The exact order (a descending, j ascending, r ascending, zeros dropped) is the
contract other implementations of the schedulers (e.g. a GPU kernel) are checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from vllm_dspark.scheduling.sps import SpsCurve

SpsFunction = Callable[[np.ndarray], np.ndarray]


def check_confidences(confidences: np.ndarray) -> np.ndarray:
    """Return `confidences` as float64 [R, K]; reject wrong shapes, NaN and values outside [0, 1].

    Out-of-range values are an error rather than a clamp: they mean a broken confidence head
    or calibration, and clamping would hide it while silently changing the schedule.
    """
    c = np.asarray(confidences, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be a 2-D array [R, K], got shape {c.shape}")
    if c.size and not (c.min() >= 0.0 and c.max() <= 1.0):
        if np.isnan(c).any():
            raise ValueError("confidences contain NaN")
        raise ValueError(
            f"confidences must lie in [0, 1], got values in [{c.min()}, {c.max()}]"
        )
    return c


class Ranking(NamedTuple):
    """Candidates with a > 0 in scheduling order, and the survival table they come from."""

    survival: np.ndarray  # a of each candidate in order (descending in `rank_candidates`)
    order: np.ndarray  # flat position-major index (j - 1) * R + r of each candidate
    num_requests: int
    table: np.ndarray  # a[r, j] stored position-major, shape [K, R]

    def requests(self, count: int | None = None) -> np.ndarray:
        """r of the first `count` candidates (all by default)."""
        return self.order[:count] % self.num_requests

    def positions(self) -> np.ndarray:
        """j (1-based) of every candidate."""
        return self.order // self.num_requests + 1


_ONE_BITS = np.uint64(0x3FF0000000000000)  # bit pattern of 1.0
# Cliffs of the SPS curve an early-stopping scan may look past per step (`cliff_aware_stop`);
# each look is one vectorised pass over the slots.
MAX_CLIFF_CHECKS = 32


def _descending_order(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorting `survival` (values in [0, 1]) descending, ties by index ascending,
    and the sorted values.

    Same result as a stable argsort of -survival, about twice as fast on the sizes that
    matter (R * K ~ 2K): the bit pattern of a non-negative float64 orders like its value,
    so its high bits and the index are packed into one unique uint64 key and sorted with
    a plain (unstable, faster) sort. The dropped low mantissa bits can reorder values that
    differ by less than 2^-40 relative; such an order is detected and redone exactly.
    """
    shift = np.uint64(max(1, (survival.size - 1).bit_length()))
    key = ((_ONE_BITS >> shift) - (survival.view(np.uint64) >> shift)) << shift
    key |= np.arange(survival.size, dtype=np.uint64)
    order = (np.sort(key) & ((np.uint64(1) << shift) - np.uint64(1))).astype(np.intp)
    ranked = survival[order]
    if (ranked[1:] > ranked[:-1]).any():
        order = np.argsort(-survival, kind="stable")
        ranked = survival[order]
    return order, ranked


def rank_candidates(c: np.ndarray, weights: np.ndarray | None = None) -> Ranking:
    """Sort the draft slots of a checked [R, K] confidence array into scheduling order.

    `weights` (per request, >= 0) rank by a[r, j] * weights[r] instead of a[r, j]; a
    per-request constant keeps each request's own slots in position order.
    """
    # Position-major layout (flat index = (j-1) * R + r): sorting by a descending with ties
    # by flat index gives ties by j first and r second, exactly the documented order.
    table = np.cumprod(c.T, axis=0)
    survival = table.ravel()
    if weights is None:
        order, ranked = _descending_order(survival)
    else:
        order, _ = _descending_order((table * (weights / weights.max())).ravel())
        ranked = survival[order]
    count = np.count_nonzero(survival)
    return Ranking(ranked[:count], order[:count], c.shape[0], table)


def rank_by_user_gain(c: np.ndarray) -> tuple[Ranking, np.ndarray]:
    """The candidate order of the per-user objective, and each candidate's gain in it.

    Verifying slot (r, j) raises request r's expected tokens this step from 1 + A[r, j-1]
    to 1 + A[r, j] (A the running sum of its survivals), a gain in log speed of
    u[r, j] = log(1 + a[r, j] / (1 + A[r, j-1])). Candidates are ranked by u descending,
    ties as in `rank_candidates` (smaller j, then smaller r). u falls strictly along a
    request's block (a does not rise and A grows), so every prefix of this order still
    verifies a prefix of each request's block, and u[r, j] reads only c[r, 1..j]: the
    two properties that keep an early-stopping scan lossless (module docstring).
    """
    table = np.cumprod(c.T, axis=0)
    gains = np.log1p(table / (1.0 + np.cumsum(table, axis=0) - table))
    order, ranked = _descending_order(gains.ravel())  # gains lie in [0, log 2]
    count = np.count_nonzero(ranked)
    return Ranking(table.ravel()[order[:count]], order[:count], c.shape[0], table), ranked[:count]


def expected_throughput(
    ranking: Ranking, sps: SpsFunction, base_tokens: int, plain_requests: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Expected tokens per step and SPS after verifying the first n candidates, n = 0..N.

    tau(n) = R + plain_requests + sum of the first n survivals (each request gains its
    bonus token, and so does each decoding request of the pass with nothing to verify),
    and the pass carries B(n) = base_tokens + R + n tokens (base_tokens counts those
    requests' tokens).
    """
    tau = np.empty(len(ranking.survival) + 1)
    tau[0] = 0.0
    np.cumsum(ranking.survival, out=tau[1:])
    tau += ranking.num_requests + plain_requests
    return tau, pass_sps(sps, base_tokens + ranking.num_requests, len(tau))


# The decoding part of a pass with a prompt never costs less than this fraction of the
# decode-only pass (`decoding_part`).
MIN_DECODING_FRACTION = 0.5


def decoding_part(sps: SpsFunction, prompt_tokens: int, decoding_tokens: int) -> SpsFunction:
    """SPS of the decoding part of a pass that also prefills `prompt_tokens` prompt tokens,
    beside `decoding_tokens` decoding tokens (no drafts): T'(B) = T(B + P) - (T(D + P) - T(D)),
    B counting the decoding tokens and drafts.

    Per-step throughput tau / T(B) would charge a prefill's time to the step's decoding
    tokens: beside a 200-token prompt at 16 requests on a CPU the pass lasts about seven
    decode steps, so every token of it looks seven times as valuable and drafts of a few
    percent survival get verified, each slowing the prefill by a full token's time (traced:
    34 drafts verified in such steps against 17 for vLLM's fixed three-token lookup). The
    prompt's time is spent whatever is verified, so it is taken out; a draft still costs
    the slope of the curve where the pass really is. A jagged curve can fall beyond the
    pass by more than a decode step, which no pass does; the decoding part is kept at
    `MIN_DECODING_FRACTION` of the decode-only step at least. Reads only token counts the
    scheduler knows before any draft is drawn, so the policies stay lossless."""
    if prompt_tokens <= 0:
        return sps
    decoding = np.asarray(float(decoding_tokens))
    decode_only_s = 1.0 / float(sps(decoding))
    prompt_s = 1.0 / float(sps(decoding + prompt_tokens)) - decode_only_s

    def without_prompt(batch_tokens: np.ndarray) -> np.ndarray:
        steps = np.asarray(sps(np.asarray(batch_tokens, dtype=np.float64) + prompt_tokens), dtype=np.float64)
        return 1.0 / np.maximum(1.0 / steps - prompt_s, MIN_DECODING_FRACTION * decode_only_s)

    return without_prompt


def pass_sps(sps: SpsFunction, first: int, count: int) -> np.ndarray:
    """SPS for passes of first, first + 1, ..., first + count - 1 tokens."""
    if isinstance(sps, SpsCurve):
        return sps.over_range(first, count)
    batch = np.arange(first, first + count, dtype=np.float64)
    return np.asarray(sps(batch), dtype=np.float64)


def cliff_aware_stop(
    values: np.ndarray,
    totals: np.ndarray,
    objective: np.ndarray,
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
    lookahead: Callable[[], tuple[np.ndarray, np.ndarray]] | None,
    max_checks: int = MAX_CLIFF_CHECKS,
) -> int:
    """Number of candidates an early-stopping scan verifies when it may step over a cliff of
    the SPS curve. The scan's objective after n candidates is objective[n] =
    combine(totals[n], SPS(B(n))), with totals[n] the sum of the first n candidates'
    `values` (throughput: tau from the survivals, combined as tau * SPS; the per-user
    objective: the sum of log-speed gains, combined as gains + R log SPS). At a candidate
    that does not raise the objective (objective[n + 1] <= objective[n]), the scan goes on
    if verifying it and the candidates expected after it could still beat the current
    objective. `lookahead()` gives (reach, expected_tail), built only when a stop is
    questioned (not on the hot path otherwise): reach[m] the SPS with m slots verified, up
    to all R * K (`pass_sps`), expected_tail[m] the value of rank m in an earlier step
    rescaled to this step's requests (`tail_from`), capped here by the current candidate's
    own value, which bounds every later one (values come in descending order). Without a
    `lookahead` it is the plain early stop.

    Lossless like the plain early stop: whether candidate n is verified depends only on the
    values of candidates 0..n (which read no token of request r beyond position j), on
    earlier steps and on constants, never on how many candidates follow n or their
    values. An estimate can be too high, so the scan may end just past a cliff below the
    objective it had before it; going back would read later confidences (DSPARK.md's
    counter-example).
    """
    improves = objective[1:] > objective[:-1]  # whether candidate n raises the objective
    count = stopping_point(improves)
    if lookahead is None or count >= len(values):
        return count
    reach, expected_tail = lookahead()
    slots = len(reach) - 1
    for _ in range(max_checks):
        if count >= len(values):
            break
        expected = np.minimum(values[count], expected_tail[count:slots])
        expected[0] = values[count]  # the candidate itself is known
        if not (combine(totals[count] + np.cumsum(expected), reach[count + 1:]) > objective[count]).any():
            break
        count += 1 + stopping_point(improves[count + 1:])
    return count


def tail_from(values: np.ndarray, num_requests: int, for_requests: int, slots: int) -> np.ndarray:
    """Ranked candidate values of an earlier step with `num_requests` requests, as an
    estimate for ranks 0..slots-1 of a step with `for_requests`: rank m reads the earlier
    rank m * num_requests / for_requests (0 beyond the earlier candidates)."""
    ranks = (np.arange(slots) * num_requests) // max(1, for_requests)
    padded = np.append(values, 0.0)
    return padded[np.minimum(ranks, len(values))]


def stopping_point(improves: np.ndarray) -> int:
    """Number of candidates an early-stopping scan verifies.

    `improves[n]` says whether adding candidate n (0-based) improved the scan's objective;
    the scan stops at the first candidate that does not.
    """
    return len(improves) if improves.all() else int(np.argmin(improves))


def lengths_of_prefix(ranking: Ranking, count: int) -> np.ndarray:
    """Per-request verification lengths when the first `count` candidates are verified."""
    return np.bincount(ranking.requests(count), minlength=ranking.num_requests).astype(np.int64)
