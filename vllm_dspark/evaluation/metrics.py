"""Acceptance statistics of a set of speculative rounds.

tau counts the bonus/resampled token (no speculation gives tau = 1). Rounds of one prompt
are correlated (easy and hard answers), so tau's standard error is clustered by prompt
(ratio-estimator linearisation); the i.i.d. error is reported too, for comparison.
"""

from __future__ import annotations

import numpy as np

ECE_BINS = 10


def expected_calibration_error(predicted: np.ndarray, observed: np.ndarray, bins: int = ECE_BINS) -> float:
    """Mean |predicted - observed| over equal-width probability bins, weighted by bin size."""
    which = np.minimum((predicted * bins).astype(np.int64), bins - 1)
    error = 0.0
    for b in np.unique(which):
        in_bin = which == b
        error += in_bin.sum() * abs(predicted[in_bin].mean() - observed[in_bin].mean())
    return float(error / len(predicted))


def _per_position(values: np.ndarray, include: np.ndarray) -> list[float | None]:
    """Column means of `values` [M, K] over rows where `include` [M, K] holds."""
    counts = include.sum(0)
    sums = np.where(include, values, 0.0).sum(0)
    return [float(s / c) if c else None for s, c in zip(sums, counts)]


def summarise_rounds(accepted: np.ndarray, confidences: np.ndarray, prompt_ids: np.ndarray) -> dict:
    """accepted [M] in 0..K; confidences [M, K] conditional c_k; prompt_ids [M]."""
    m, k = confidences.shape
    if m == 0:
        raise ValueError("no speculative rounds: every answer ended with its first token")
    lengths = accepted.astype(np.float64) + 1.0
    tau = float(lengths.mean())
    positions = np.arange(1, k + 1)
    survived = accepted[:, None] >= positions  # draft k accepted (with all before it)
    reached = accepted[:, None] >= positions - 1  # draft k was judged
    _, cluster = np.unique(prompt_ids, return_inverse=True)
    groups = int(cluster.max()) + 1
    if groups > 1:
        residual_sums = np.bincount(cluster, weights=lengths - tau, minlength=groups)
        tau_stderr = float(np.sqrt(groups / (groups - 1) * (residual_sums**2).sum()) / m)
    else:
        tau_stderr = None
    prefix_confidence = np.cumprod(confidences, axis=1)
    return {
        "rounds": int(m),
        "tau": tau,
        "tau_stderr": tau_stderr,
        "tau_stderr_iid": float(lengths.std(ddof=1) / np.sqrt(m)) if m > 1 else None,
        "accepted_histogram": np.bincount(accepted, minlength=k + 1).tolist(),
        # P(accept draft k | drafts 1..k-1 accepted), the paper's Figure 2.
        "acceptance_by_position": _per_position(survived.astype(np.float64), reached),
        "reached_by_position": reached.sum(0).tolist(),
        # Calibrated c_k, averaged where it is a prediction of the rate above.
        "mean_confidence_by_position": _per_position(confidences, reached),
        # a_k = c_1 ... c_k against the observed P(drafts 1..k all accepted), all rounds.
        "mean_prefix_confidence_by_position": prefix_confidence.mean(0).tolist(),
        "prefix_survival_by_position": survived.mean(0).tolist(),
        "prefix_confidence_ece": expected_calibration_error(prefix_confidence.ravel(), survived.ravel()),
    }
