"""Engine throughput profile SPS(B): target engine steps per second for a pass of B tokens.

The verification scheduler trades accepted tokens against pass cost, so it needs the cost of
a forward pass as a function of the number of tokens it carries. The profile is a small
table measured once per (model, dtype, hardware, vLLM version); this module validates it,
stores it as JSON and evaluates it for whole arrays of batch sizes at once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pydantic

_FAR = float(2**40)  # tokens; beyond any real pass, so the sentinel never clamps


class SpsCurve(pydantic.BaseModel):
    """Steps per second against batch tokens, interpolated linearly in step time.

    Interpolating step *time* (1/SPS) rather than SPS matches how cost grows: the time of a
    pass is close to piecewise linear in its token count. Below the first point the first
    value holds (a pass never gets cheaper than the smallest measured one). Beyond the last
    point step time is extrapolated from the last two points, with the slope clamped at zero
    so that a noisy, decreasing tail never predicts free or negative-time passes.
    """

    model_config = pydantic.ConfigDict(frozen=True)

    points: list[tuple[int, float]]
    metadata: dict[str, str] = {}

    @pydantic.field_validator("points")
    @classmethod
    def _check_points(cls, points: list[tuple[int, float]]) -> list[tuple[int, float]]:
        if not points:
            raise ValueError("an SPS curve needs at least one (batch_tokens, sps) point")
        previous = 0
        for batch, sps in points:
            if batch < 1:
                raise ValueError(f"batch_tokens must be >= 1, got {batch}")
            if batch <= previous:
                raise ValueError(
                    f"batch_tokens must be strictly increasing, got {batch} after {previous}"
                )
            if not math.isfinite(sps) or sps <= 0:
                raise ValueError(f"steps_per_second must be finite and > 0, got {sps} at B={batch}")
            previous = batch
        return points

    def model_post_init(self, __context: object) -> None:
        batch = [float(b) for b, _ in self.points]
        step_time = [1.0 / s for _, s in self.points]
        fastest = min(step_time)
        slope = 0.0
        if len(batch) > 1:
            slope = max(0.0, (step_time[-1] - step_time[-2]) / (batch[-1] - batch[-2]))
        # A far sentinel point makes np.interp itself do the tail extrapolation.
        batch.append(batch[-1] + _FAR)
        step_time.append(step_time[-1] + slope * _FAR)
        self._cache(_min_step_time=fastest, _batch=np.array(batch), _step_time=np.array(step_time),
                    _per_token=np.empty(0))

    def _cache(self, **values: object) -> None:
        """Keep derived tables as plain instance attributes: pydantic serves its private
        attributes through `__getattr__`, about 3 us a read, and the scheduler reads these
        several times every engine step. They are not fields, so they are never dumped."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        # pydantic's default also compares the NumPy caches, which has no truth value.
        if not isinstance(other, SpsCurve):
            return NotImplemented
        return self.points == other.points and self.metadata == other.metadata

    def __hash__(self) -> int:
        return hash((tuple(self.points), tuple(sorted(self.metadata.items()))))

    def step_time(self, batch_tokens: np.ndarray | int) -> np.ndarray | float:
        """Seconds per engine step for passes of `batch_tokens` tokens (vectorised)."""
        seconds = np.interp(batch_tokens, self._batch, self._step_time)
        return float(seconds) if np.ndim(seconds) == 0 else seconds

    def __call__(self, batch_tokens: np.ndarray | int) -> np.ndarray | float:
        """Steps per second for passes of `batch_tokens` tokens (vectorised)."""
        return 1.0 / self.step_time(batch_tokens)

    @property
    def min_step_time(self) -> float:
        """Seconds of the fastest step on the curve."""
        return self._min_step_time

    def with_step_model(self, scale: float, offset: float) -> SpsCurve:
        """The curve with each step time t replaced by scale * t + offset (a learned model of
        the serving engine, `scheduling/overhead.py`).

        Exact for the interpolation: step time is linear between points, so an affine map of
        each point maps it everywhere, the tail included.
        """
        fastest = scale * self.min_step_time + offset
        if not (math.isfinite(scale) and math.isfinite(offset) and scale > 0 and fastest > 0):
            raise ValueError(
                f"step model (scale {scale}, offset {offset} s) must be finite with scale > 0 and keep "
                f"the fastest step ({self.min_step_time:.6f} s) positive"
            )
        points = [(batch, 1.0 / (scale / sps + offset)) for batch, sps in self.points]
        return SpsCurve(points=points, metadata=self.metadata)

    def over_range(self, first: int, count: int) -> np.ndarray:
        """SPS for B = first, first + 1, ..., first + count - 1 (read-only view).

        The scheduler asks for consecutive batch sizes every step; a per-token table,
        grown by doubling, turns that into a slice instead of an interpolation.
        """
        end = first + count
        if end > len(self._per_token):
            table = self(np.arange(max(end, 2 * len(self._per_token), 64), dtype=np.float64))
            table.flags.writeable = False
            self._cache(_per_token=table)
        return self._per_token[first:end]

    @classmethod
    def load(cls, path: str | Path) -> SpsCurve:
        """Read and validate a profile written by `save`; errors name the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"SPS profile {path} does not exist (create it with `vllm-dspark profile`)"
            ) from None
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, pydantic.ValidationError) as error:
            raise ValueError(f"{path} is not a valid SPS profile: {error}") from error

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (points and metadata only)."""
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")
