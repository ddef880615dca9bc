"""The step time the SPS profile does not predict, learned from the running engine.

`vllm-dspark profile` times target decode passes of a quiet engine at one context length.
The engine that serves differs from it in two ways. Some of the difference is per step
(the proposer, the scheduler's own work, a profile taken under another configuration): an
offset. Some of it grows with the pass (longer contexts make every token dearer; an API
server, its detokenizer and its clients share the CPU with the model): a scale. The
policies compare expected tokens per second over candidate verification lengths, so the
two are not interchangeable: an offset makes each verified token relatively cheaper, a
scale makes it dearer. Learning an offset alone from steps that really take twice the
profile teaches the policies that verification is cheap, and they verify more exactly
where they should verify less (`vllm bench serve`, SmolLM2 on this CPU, 16 users: plain
steps of 122 ms against 54 ms profiled, and dspark drafting on most steps at 0.76x the
per-user speed of plain decoding).

The scheduler times consecutive decode steps, takes out the drafting it measured in them
(the drafting cost model prices that), and feeds (measured, profiled) pairs to `StepTimeModel`,
which fits measured ~ scale * profiled + offset by exponentially weighted least squares
with a ridge towards the profile as given (scale 1, offset 0). Steps of varied size (probes,
verification lengths, requests coming and going) tell the two apart; while all
steps have the same profiled time the ridge splits the difference evenly between them.
The policies then use `SpsCurve.with_step_model(scale, offset)`, which never gets below
`MIN_STEP_FRACTION` of the profile's fastest step.

Steps that carry prompt tokens are not timed. The profile times decode passes; a prefill
token skips the LM head and the sampler, and a pass of many prompts lies far beyond the
profile's last point, where its step time is an extrapolation. Such points have the most
leverage in a least-squares fit: in the serving frontier, whose waves prefill 64 prompts at
once, the first version of this model (prefills included) drafted on 99% of the steps at
64 requests, where the offset-only one had skipped 86-90%, and dspark fell from 0.96x to
0.80x the per-user speed of plain decoding (most likely taught by those passes that steps
cost a fraction of the profile).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_dspark.scheduling.sps import SpsCurve

# A learned model may shorten the profile's fastest step to this fraction, no further.
MIN_STEP_FRACTION = 0.5
# The learned scale stays within [1 / MAX_SCALE, MAX_SCALE] of the profile.
MAX_SCALE = 8.0


@dataclass
class StepTimeModel:
    """measured step time ~ scale * profiled + offset, from recent steps.

    `smoothing` is the weight of the newest step (exponential forgetting: the fit follows
    about 1 / smoothing recent steps). `ridge` is the prior's weight relative to the data:
    a scale is learned once the profiled step times of recent steps vary by more than about
    sqrt(ridge) of their size. A step longer than `outlier_factor` times the expected step
    is a stall, not a step, and is skipped, as is a non-positive interval; the expected step
    is the larger of the typical measured step (a moving average, so a profile far off does
    not make every step an outlier) and the model's prediction. After `max_skipped` skips in
    a row the next step counts, as the start of a new regime, so the model cannot freeze.
    Idle gaps between requests are the caller's to leave out.
    """

    smoothing: float = 0.05
    ridge: float = 0.003
    outlier_factor: float = 4.0
    max_skipped: int = 8
    typical_step_s: float = 0.0
    samples: int = 0
    skipped_in_a_row: int = 0
    # Exponentially weighted sums over steps of (x^2, x, 1, x y, y) (x profiled, y measured):
    # Python floats, as the fit runs every step and NumPy's call overhead on five numbers
    # would cost more than the arithmetic.
    _sums: tuple[float, ...] = field(default=(0.0,) * 5, repr=False)
    _fit: tuple[float, float] = (1.0, 0.0)

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")
        if self.ridge <= 0.0:
            raise ValueError(f"ridge must be > 0, got {self.ridge}")
        if self.outlier_factor <= 1.0:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor}")

    @property
    def scale(self) -> float:
        return self._fit[0]

    @property
    def offset(self) -> float:
        """Seconds per step beyond the scaled profile (signed)."""
        return self._fit[1]

    def predict(self, profiled_s: float) -> float:
        return self.scale * profiled_s + self.offset

    def observe(self, measured_s: float, profiled_s: float) -> bool:
        """Take one step's measured wall time; True if it was used."""
        if measured_s <= 0.0 or profiled_s <= 0.0:
            return False
        expected = max(self.typical_step_s, self.predict(profiled_s))
        stall = self.samples > 0 and measured_s > self.outlier_factor * expected
        if stall and self.skipped_in_a_row < self.max_skipped:
            self.skipped_in_a_row += 1
            return False
        self.skipped_in_a_row = 0
        # The end of a run of skips is a new regime: what came before is forgotten.
        keep = 0.0 if stall else 1.0 - self.smoothing
        x, y = profiled_s, measured_s
        self._sums = tuple(keep * total + term for total, term in zip(self._sums, (x * x, x, 1.0, x * y, y)))
        self.typical_step_s = y if self.samples == 0 or stall else self.typical_step_s + self.smoothing * (y - self.typical_step_s)
        self.samples += 1
        self._fit = self._solve()
        return True

    def _solve(self) -> tuple[float, float]:
        """Ridge least squares: minimise sum w (y - s x - o)^2 + ridge ((s - 1)^2 sum w x^2
        + o^2 sum w), the prior scaled like the data so that its pull stays relative."""
        xx, x, n, xy, y = self._sums
        prior = 1.0 + self.ridge
        # The 2 x 2 normal equations [[xx p, x], [x, n p]] (scale, offset) = (xy + ridge xx, y),
        # by Cramer's rule (the ridge keeps the determinant positive).
        target = xy + self.ridge * xx
        determinant = xx * prior * n * prior - x * x
        free_scale = (target * n * prior - x * y) / determinant
        offset = (xx * prior * y - x * target) / determinant
        scale = min(max(free_scale, 1.0 / MAX_SCALE), MAX_SCALE)
        if scale != free_scale:
            offset = (y - scale * x) / (n * prior)  # the best offset for the clamped scale
        return scale, offset


def applied_model(curve: SpsCurve, scale: float, offset: float) -> tuple[float, float]:
    """The learned model as applied to `curve`: the offset raised where it would make the
    fastest step shorter than `MIN_STEP_FRACTION` of itself."""
    return scale, max(offset, (MIN_STEP_FRACTION - scale) * curve.min_step_time)
