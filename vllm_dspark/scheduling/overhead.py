"""Per-step time the SPS profile does not predict, learned from the running engine.

`vllm-dspark profile` times target decode passes. A speculative step also runs the
drafter and the proposer, a cost that depends on the number of requests but not on how
many drafts are verified; and a profile taken under another configuration (context
length, batch limits, a busy moment) is off by a roughly constant amount too. The
policies compare expected tokens per second over candidate verification lengths, so a
constant left out of the step time misprices every extra verified token: too few drafts
are verified when steps really take longer than the profile says, too many when shorter.

The scheduler times consecutive steps and feeds (measured, profiled) step times to
`StepOverheadEstimator`; the policies then use `SpsCurve.with_step_overhead(seconds)`,
whose step time is T_profile(B) + seconds. The offset is signed, and the curve never
gets below half its own fastest step (`MIN_STEP_FRACTION`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dspark.scheduling.sps import SpsCurve

# A learned negative offset may shorten the profile's steps to this fraction, no further.
MIN_STEP_FRACTION = 0.5


@dataclass
class StepOverheadEstimator:
    """Exponential moving average of measured minus profiled step time (signed).

    A step longer than `outlier_factor` times the expected step is a stall, not a step, and
    is skipped; so is a non-positive interval. The expected step is the larger of the
    typical measured step (a moving average too, so a profile far off does not make every
    step an outlier) and the profiled step plus the offset (so heavier traffic, whose
    profiled steps are longer, is not either). After `max_skipped` skips in a row the next
    interval is taken as is, as the start of a new regime, so the estimate cannot freeze.
    Idle gaps between requests are the caller's to leave out. `smoothing` is the weight of
    each new sample; the first sample is taken as is.
    """

    smoothing: float = 0.1
    outlier_factor: float = 4.0
    max_skipped: int = 8
    seconds: float = 0.0
    typical_step_s: float = 0.0
    samples: int = 0
    skipped_in_a_row: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")
        if self.outlier_factor <= 1.0:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor}")

    def observe(self, measured_s: float, profiled_s: float) -> bool:
        """Take one step's measured wall time; True if it was used."""
        if measured_s <= 0.0:
            return False
        expected = max(self.typical_step_s, profiled_s + self.seconds)
        stall = self.samples > 0 and measured_s > self.outlier_factor * expected
        if stall and self.skipped_in_a_row < self.max_skipped:
            self.skipped_in_a_row += 1
            return False
        self.skipped_in_a_row = 0
        # A first sample, or the end of a run of skips (a new regime): taken as is.
        weight = 1.0 if self.samples == 0 or stall else self.smoothing
        self.seconds += weight * (measured_s - profiled_s - self.seconds)
        self.typical_step_s += weight * (measured_s - self.typical_step_s)
        self.samples += 1
        return True


def offset_for(curve: SpsCurve, seconds: float) -> float:
    """The learned offset as applied to `curve`: never below what would shorten its fastest
    step to `MIN_STEP_FRACTION` of itself."""
    return max(seconds, -(1.0 - MIN_STEP_FRACTION) * curve.min_step_time)
