"""SLA-aware verification: maximise throughput while every user keeps a tokens/s floor.

Predicted per-user speed of request r verifying l_r drafts is
v_r = (1 + a[r, 1] + ... + a[r, l_r]) * SPS(B): expected tokens per step times steps per
second. Verifying more tokens raises throughput and the speed of the request that gains
them, but slows every request in the pass through a lower SPS(B).

Losslessness. The plan is an early-stopping scan over the same candidate order as `dspark`
(see `ranking`), with a different stopping test. Whether candidate n is verified depends
only on candidates 0..n of that order, and (r, j+1) always comes after (r, j); so whether
draft token j of request r is verified never depends on c[r, j+1], which reads token j.
A search that looked ahead and picked the best prefix afterwards would not have this
property (DSPARK.md section 4).

Stopping test, with rho(n) = min_r v_r(n) / floor_r the worst user's floor ratio, where a
request the scan has not reached yet is counted as if its first draft were verified
(v_r uses 1 + a[r, 1]). Without that, every request ahead of its first candidate would
look slower with each candidate verified for the others, and a floor that verifying one
token for everybody easily meets would stop the scan after a few candidates. Reading
a[r, 1] = c[r, 1] is allowed: it depends only on the committed anchor token, never on a
draft token of r. The report (`SlaPlan`) uses the actual lengths, so a request the scan
never reached shows up there as missing its floor if it does.
- while the floors hold (rho >= 1), a candidate is taken if throughput strictly rises and
  the floors still hold afterwards: greedy throughput under the constraint;
- while they do not hold, a candidate is taken if it strictly raises throughput: floors
  that cannot be met mean overload, which admission control, not verification length,
  must fix (`SlaPlan.floor_met` reports it); meanwhile serving as many tokens as possible
  is what helps every user. The priority below still puts the slow requests' drafts first.
  An earlier rule also took candidates that raised rho at a loss of throughput, i.e.
  bought drafts that cost more than they return exactly when the engine is overloaded.
  (Measured with `vllm bench serve`, SmolLM2 on this CPU, a floor of 8 tokens/s, single
  runs: below plain decoding at 16 and 64 users under either rule, 0.90x / 0.75x before
  and 0.78x / 0.76x after, while sla still drafted all K positions every step.)
Since sla takes only throughput-raising candidates either way, the controller drafts for
it as for dspark: the depth that maximises expected throughput, with dspark's early stop
(`policies.never_verified_below`). A floor therefore orders the drafts a step has; it
does not make a step draft deeper than throughput pays for.
A floor of 0 means no constraint; with all floors 0 the policy equals `dspark`.

Priority. A request that asks for a higher floor than it is predicted to reach is moved
forward in the scan: candidates are ranked by a[r, j] * g_r with
g_r = max(1, floor_r / v_r(1)), v_r(1) its predicted speed with one draft verified. g_r is
one number per request and reads only c[r, 1] (the committed anchor), so each request's
slots stay in position order and the losslessness argument above is unchanged; without
it, the early stop would usually end the scan before the slow request's slots come up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dspark.scheduling.ranking import (
    SpsFunction,
    check_confidences,
    expected_throughput,
    lengths_of_prefix,
    rank_candidates,
    stopping_point,
)


# Per-request floor a client can ask for: SamplingParams(extra_args={...}), over HTTP
# `vllm_xargs`.
MIN_TOKENS_PER_S_ARG = "dspark_min_tokens_per_s"


def request_floor(extra_args: Mapping[str, Any] | None, default: float, *, strict: bool = False) -> float:
    """A request's tokens/s floor from its `extra_args`, else `default`.

    A client's value that is not a finite number >= 0 must never reach the policy (it would
    raise inside the engine's step): it falls back to `default` (documented safe fallback),
    or raises ValueError naming the field with `strict` (used to warn at admission).
    """
    if not extra_args or MIN_TOKENS_PER_S_ARG not in extra_args:
        return default
    value = extra_args[MIN_TOKENS_PER_S_ARG]
    try:
        floor = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        floor = math.nan
    if math.isfinite(floor) and floor >= 0.0:
        return floor
    if strict:
        raise ValueError(f"extra_args['{MIN_TOKENS_PER_S_ARG}'] must be a finite number >= 0, got {value!r}")
    return default


@dataclass(frozen=True)
class SlaPlan:
    """The chosen lengths and what the scheduler predicts for them."""

    lengths: np.ndarray  # int64 [R] draft tokens to verify
    tokens_per_s: np.ndarray  # float [R] predicted per-user speed
    floor_met: np.ndarray  # bool [R] predicted speed >= floor
    throughput: float  # predicted system tokens/s

    @property
    def feasible(self) -> bool:
        """Whether every request is predicted to meet its floor."""
        return bool(self.floor_met.all())


def _floors(min_tokens_per_s: float | np.ndarray, num_requests: int) -> np.ndarray:
    floors = np.broadcast_to(np.asarray(min_tokens_per_s, dtype=np.float64), (num_requests,))
    if not np.isfinite(floors).all() or (floors < 0).any():
        raise ValueError("min_tokens_per_s must be finite and >= 0 (a float or an array [R])")
    return floors


def plan_sla(
    confidences: np.ndarray,
    sps: SpsFunction,
    min_tokens_per_s: float | np.ndarray,
    *,
    base_tokens: int = 0,
    plain_requests: int = 0,
) -> SlaPlan:
    """Plan verification lengths under per-user speed floors (see the module docstring).
    `plain_requests` of the `base_tokens` are decoding requests with nothing to verify:
    their tokens count in throughput; their floors are not checked here."""
    c = check_confidences(confidences)
    num_requests, block = c.shape
    floors = _floors(min_tokens_per_s, num_requests)
    if c.size == 0:
        speeds = np.full(num_requests, float(sps(np.asarray(base_tokens + num_requests))))
        return SlaPlan(np.zeros(num_requests, np.int64), speeds, speeds >= floors, speeds.sum())
    first_draft_speed = (1.0 + c[:, 0]) * float(sps(np.asarray(base_tokens + num_requests + 1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        priority = np.maximum(1.0, np.nan_to_num(floors / first_draft_speed, posinf=1e6))
    ranking = rank_candidates(c, priority)
    tau, steps = expected_throughput(ranking, sps, base_tokens, plain_requests)
    theta = tau * steps
    count = len(ranking.survival)

    # Expected tokens per step of request r after its first j drafts, stored [K + 1, R]:
    # 1 + a[r, 1] + ... + a[r, j].
    per_step = np.ones((block + 1, num_requests))
    np.cumsum(ranking.table, axis=0, out=per_step[1:])
    per_step[1:] += 1.0
    with np.errstate(divide="ignore"):
        inv_floor = 1.0 / floors  # a floor of 0 never binds: inf ratio
    # What the scan assumes: a request not reached yet counts as if its first draft were in.
    planned = per_step.copy()
    planned[0] = per_step[1]
    # Worst ratio min_r planned_r(n) / floor_r for every prefix n, without an [N, R] array:
    # a request's ratio only grows along the scan, so its value before candidate p (the one
    # that raises it) is the last one it holds at time p, and the minimum over requests at
    # time n is a suffix minimum over those "last held" values plus the final levels.
    held = np.empty(count + 1)
    request = ranking.requests()
    held[:count] = planned[ranking.positions() - 1, request] * inv_floor[request]
    requests = np.arange(num_requests)
    final_level = np.count_nonzero(ranking.table, axis=0)
    held[count] = (planned[final_level, requests] * inv_floor).min()
    worst = np.minimum.accumulate(held[::-1])[::-1] * steps

    capped = np.minimum(worst, 1.0)
    theta_up = theta[1:] > theta[:-1]
    improves = theta_up & ((capped[:-1] < 1.0) | (capped[1:] >= 1.0))
    chosen = stopping_point(improves)
    lengths = lengths_of_prefix(ranking, chosen)
    tokens = per_step[lengths, requests]
    met = tokens * inv_floor * steps[chosen] >= 1.0
    return SlaPlan(lengths, tokens * steps[chosen], met, float(theta[chosen]))
