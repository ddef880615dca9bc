"""Per-step time the SPS profile does not contain, learned from the running engine.

`vllm-dspark profile` times target decode passes. A speculative step also runs the
drafter and the proposer, a cost that depends on the number of requests but not on how
many drafts are verified. The policies compare expected tokens per second over candidate
verification lengths; leaving this fixed cost out overstates how much each extra verified
token slows the step, so they verify too few drafts (measured here on CPU: the `dspark`
policy fell below verifying all drafts at one request).

The scheduler times consecutive steps and feeds (measured, profiled) step times to
`StepOverheadEstimator`; the policies then use `SpsCurve.with_step_overhead(seconds)`,
whose step time is T_profile(B) + overhead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOverheadEstimator:
    """Exponential moving average of max(0, measured - profiled) step time.

    A step longer than `outlier_factor` times the typical measured step (a moving average
    too) is a stall, not a step, and is skipped; so is a non-positive interval. The outlier
    test reads measured times only, so it holds however wrong the profile is. Idle gaps
    between requests are the caller's to leave out. `smoothing` is the weight of each new
    sample; the first sample is taken as is.
    """

    smoothing: float = 0.1
    outlier_factor: float = 4.0
    seconds: float = 0.0
    typical_step_s: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")
        if self.outlier_factor <= 1.0:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor}")

    def observe(self, measured_s: float, profiled_s: float) -> bool:
        """Take one step's measured wall time; True if it was used."""
        if measured_s <= 0.0 or (self.samples and measured_s > self.outlier_factor * self.typical_step_s):
            return False
        weight = 1.0 if self.samples == 0 else self.smoothing
        self.seconds += weight * (max(0.0, measured_s - profiled_s) - self.seconds)
        self.typical_step_s += weight * (measured_s - self.typical_step_s)
        self.samples += 1
        return True
