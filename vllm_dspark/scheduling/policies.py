"""Verification-length policies: how many draft tokens of each request the target verifies.

One entry point, `select_verify_lengths`, serves the engine's scheduler, the simulator and
the tests, so every consumer runs the same decision code. All policies are vectorised NumPy
over the [R, K] confidence array; none loops over candidates in Python.
"""

from __future__ import annotations

import numpy as np

from vllm_dspark.scheduling.ranking import (
    SpsFunction,
    check_confidences,
    expected_throughput,
    lengths_of_prefix,
    rank_candidates,
    stopping_point,
)
from vllm_dspark.scheduling.sla import plan_sla

POLICIES = ("fixed", "threshold", "dspark", "dspark_async", "sla")

_OPTIONS: dict[str, frozenset[str]] = {
    "fixed": frozenset({"k"}),
    "threshold": frozenset({"threshold"}),
    "dspark": frozenset(),
    "dspark_async": frozenset({"budget"}),
    "sla": frozenset({"min_tokens_per_s"}),
}


def _fixed(c: np.ndarray, sps: SpsFunction, base_tokens: int, k: int | None = None) -> np.ndarray:
    """Verify the same k tokens of every request (k defaults to K, larger k is clipped to K)."""
    num_requests, block = c.shape
    k = block if k is None else int(k)
    if k < 0:
        raise ValueError(f"fixed policy needs k >= 0, got {k}")
    return np.full(num_requests, min(k, block), dtype=np.int64)


def _threshold(
    c: np.ndarray, sps: SpsFunction, base_tokens: int, threshold: float = 0.5
) -> np.ndarray:
    """Verify the longest prefix whose survival a_k is at least `threshold` (load-blind)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    return np.count_nonzero(np.cumprod(c, axis=1) >= threshold, axis=1).astype(np.int64)


def _dspark(c: np.ndarray, sps: SpsFunction, base_tokens: int) -> np.ndarray:
    """DSPARK.md section 4: scan candidates by survival, stop at the first that does not
    strictly raise expected throughput tau * SPS(B). The early stop keeps it lossless."""
    ranking = rank_candidates(c)
    tau, steps = expected_throughput(ranking, sps, base_tokens)
    theta = tau * steps
    return lengths_of_prefix(ranking, stopping_point(theta[1:] > theta[:-1]))


def dspark_budget(
    old_confidences: np.ndarray, sps: SpsFunction, base_tokens: int = 0
) -> int:
    """Total draft slots to verify, for `dspark_async`, from confidences of an earlier step.

    A full scan without early stop: the argmax of tau * SPS(B) over every prefix of the
    candidate order (smallest on ties), so it can pass the step-like cliffs of a real SPS
    curve. Looking ahead is safe only because the budget is applied to *later* confidences,
    which it cannot depend on; applied to the confidences it was computed from, it is the
    biased look-back search of DSPARK.md's counter-example.
    """
    c = check_confidences(old_confidences)
    if c.size == 0:
        return 0
    tau, steps = expected_throughput(rank_candidates(c), sps, base_tokens)
    return int(np.argmax(tau * steps))


def _dspark_async(
    c: np.ndarray, sps: SpsFunction, base_tokens: int, budget: int | None = None
) -> np.ndarray:
    """Verify the `budget` best slots in the candidate order (fewer if fewer have a > 0)."""
    if budget is None:
        raise ValueError(
            "dspark_async needs budget=dspark_budget(<confidences of an earlier step>, sps)"
        )
    if budget < 0:
        raise ValueError(f"dspark_async needs budget >= 0, got {budget}")
    return lengths_of_prefix(rank_candidates(c), int(budget))


def _sla(
    c: np.ndarray,
    sps: SpsFunction,
    base_tokens: int,
    min_tokens_per_s: float | np.ndarray | None = None,
) -> np.ndarray:
    if min_tokens_per_s is None:
        raise ValueError("sla policy needs min_tokens_per_s (a float or an array [R])")
    return plan_sla(c, sps, min_tokens_per_s, base_tokens=base_tokens).lengths


_POLICY_FUNCTIONS = {
    "fixed": _fixed,
    "threshold": _threshold,
    "dspark": _dspark,
    "dspark_async": _dspark_async,
    "sla": _sla,
}


def select_verify_lengths(
    confidences: np.ndarray,
    sps: SpsFunction,
    policy: str = "dspark",
    *,
    base_tokens: int = 0,
    **options: object,
) -> np.ndarray:
    """Number of draft tokens to verify per request, int64 [R] with values in 0..K.

    `confidences` are conditional confidences c[r, k] in [0, 1] (NaN or out-of-range values
    raise ValueError). `sps` maps batch token counts to engine steps per second, e.g. an
    `SpsCurve`. A pass carries `base_tokens` (prefill tokens of other requests) plus one
    token per decoding request plus the verified drafts. Options per policy:
    fixed: k; threshold: threshold; dspark: none; dspark_async: budget; sla:
    min_tokens_per_s.
    """
    if policy not in _POLICY_FUNCTIONS:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    unknown = options.keys() - _OPTIONS[policy]
    if unknown:
        raise ValueError(
            f"policy {policy!r} takes options {sorted(_OPTIONS[policy])}, got {sorted(unknown)}"
        )
    if base_tokens < 0:
        raise ValueError(f"base_tokens must be >= 0, got {base_tokens}")
    c = check_confidences(confidences)
    if c.size == 0:
        return np.zeros(c.shape[0], dtype=np.int64)
    return _POLICY_FUNCTIONS[policy](c, sps, base_tokens, **options)
