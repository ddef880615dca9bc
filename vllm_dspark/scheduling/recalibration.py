"""Live recalibration of draft confidences from the acceptance the engine observes.

Offline calibration (`vllm-dspark calibrate`) fits temperatures on teacher-forced blocks,
where a draft survives with the exact probability 1 - TV/2 of sampling at temperature 1.
Serving differs: greedy requests accept a draft only if it is the target's argmax, the
traffic is not the calibration set, and drafts condition on the drafter's own earlier
tokens. The committed SmolLM2 drafter, for instance, predicted about 0.19 more accepted
drafts per verified draft than the engine accepted. Every policy prices drafts by their
survival, so a systematic bias prices all of them wrong.

`OnlineRecalibrator` is online Platt scaling per block position: calibrated confidence
c'_k = sigmoid(slope_k * logit(c_k) + shift_k), both parameters moved by a gradient step
on the log-loss of every judged draft. After a request verified l drafts and the target
accepted a of them, positions 1..a were accepted and position a + 1 (if a < l) was
rejected; later positions were not judged. The shift corrects a bias, the slope
confidences that are too sharp or too flat.

A position that no request verifies in a step drifts back towards the offline
calibration (slope 1, shift 0) by the fraction `prior_pull`: a position the policy stopped
verifying because it looked hopeless gets verified again now and then, so it can recover
when the traffic changes.

Exactness: the parameters applied in a step are computed from earlier steps only, so
whether a draft is verified still does not depend on that draft (DSPARK.md section 4's
non-anticipation): the output distribution stays the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Confidences are clipped this far from 0 and 1 before taking logits.
_EPS = 1e-6


def logit(p: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)), finite for p in [0, 1] (clipped by `_EPS`; minimum and maximum
    rather than np.clip, which costs about three times as much on these small arrays and
    runs several times every engine step)."""
    p = np.minimum(np.maximum(p, _EPS), 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow warnings for large |x|."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass
class OnlineRecalibrator:
    """Per-position Platt scaling learned from judged drafts.

    `learning_rate` is the step size on the mean log-loss of a step's judged drafts at a
    position (so a position follows roughly its last 1 / learning_rate steps); the slope's
    step is divided by the mean squared logit, which makes it independent of how sharp the
    drafter is. Shifts stay within +-`max_shift`, slopes within [1 / `max_slope`,
    `max_slope`]. A zero confidence (no draft, or an invalid value already replaced by 0)
    stays 0 and teaches nothing.
    """

    learning_rate: float = 0.05
    max_shift: float = 4.0
    max_slope: float = 4.0
    prior_pull: float = 0.01
    slopes: np.ndarray = field(default_factory=lambda: np.ones(0))
    shifts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    judged: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must lie in (0, 1], got {self.learning_rate}")
        if self.max_shift <= 0.0:
            raise ValueError(f"max_shift must be > 0, got {self.max_shift}")
        if self.max_slope <= 1.0:
            raise ValueError(f"max_slope must be > 1, got {self.max_slope}")
        if not 0.0 <= self.prior_pull < 1.0:
            raise ValueError(f"prior_pull must lie in [0, 1), got {self.prior_pull}")

    def _grow(self, width: int) -> None:
        extra = width - len(self.shifts)
        if extra > 0:
            self.slopes = np.concatenate([self.slopes, np.ones(extra)])
            self.shifts = np.concatenate([self.shifts, np.zeros(extra)])
            self.judged = np.concatenate([self.judged, np.zeros(extra, dtype=np.int64)])

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        """[R, K] raw conditional confidences in [0, 1] -> calibrated ones."""
        width = confidences.shape[1]
        self._grow(width)
        calibrated = sigmoid(self.slopes[:width] * logit(confidences) + self.shifts[:width])
        return np.where(confidences > 0.0, calibrated, 0.0)

    def observe(self, confidences: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """One step's outcome: raw confidences [R, K], drafts verified [R] and accepted [R]."""
        num_requests, width = confidences.shape
        if num_requests == 0 or width == 0:
            return
        self._grow(width)
        positions = np.arange(width)
        accepted = np.minimum(accepted, verified)
        judged = (positions < verified[:, None]) & (positions <= accepted[:, None]) & (confidences > 0.0)
        # Only the judged drafts enter the gradient: work on them alone (a few per request).
        rows, cols = np.nonzero(judged)
        z = logit(confidences[rows, cols])
        error = sigmoid(self.slopes[cols] * z + self.shifts[cols]) - (cols < accepted[rows])  # d log-loss / d logit
        count = np.bincount(cols, minlength=width)
        n = np.maximum(count, 1)
        grad_shift = np.bincount(cols, error, width) / n
        grad_slope = np.bincount(cols, error * z, width) / n
        scale = np.maximum(np.bincount(cols, z * z, width) / n, 1.0)
        slopes = self.slopes[:width] - self.learning_rate * grad_slope / scale
        shifts = self.shifts[:width] - self.learning_rate * grad_shift
        # Only positions no request verified drift back: a verified draft that was never
        # reached (an earlier one was rejected) is no lack of evidence.
        idle = ~(positions < verified[:, None]).any(axis=0)
        slopes = np.where(idle, 1.0 + (1.0 - self.prior_pull) * (self.slopes[:width] - 1.0), slopes)
        shifts = np.where(idle, (1.0 - self.prior_pull) * self.shifts[:width], shifts)
        self.slopes[:width] = np.minimum(np.maximum(slopes, 1.0 / self.max_slope), self.max_slope)
        self.shifts[:width] = np.minimum(np.maximum(shifts, -self.max_shift), self.max_shift)
        self.judged[:width] += count
