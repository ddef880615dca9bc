"""The per-step time the SPS profile lacks (drafting): its estimator and its effect on SPS."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.scheduling import SpsCurve, select_verify_lengths
from vllm_dspark.scheduling.overhead import StepOverheadEstimator

# The SmolLM2 CPU profile measured here (benchmarks/results/sps_smollm2_cpu.json, rounded).
CPU_CURVE = SpsCurve(points=[(1, 29.4), (2, 24.8), (4, 24.8), (8, 13.2), (16, 13.2), (32, 10.2), (64, 5.7)])


def test_first_sample_then_moving_average():
    estimator = StepOverheadEstimator(smoothing=0.5)
    assert estimator.observe(0.030, 0.010)
    assert estimator.seconds == pytest.approx(0.020)
    assert estimator.observe(0.020, 0.010)
    assert estimator.seconds == pytest.approx(0.015)
    assert estimator.observe(0.005, 0.010)  # faster than the profile: a negative sample
    assert estimator.seconds == pytest.approx(0.005)
    assert estimator.samples == 3


def test_stalls_and_bad_intervals_are_skipped():
    estimator = StepOverheadEstimator(outlier_factor=4.0)
    assert estimator.observe(0.015, 0.010)
    assert not estimator.observe(0.5, 0.010), "a stall is not a step"
    assert not estimator.observe(0.0, 0.010)
    assert estimator.samples == 1 and estimator.seconds == pytest.approx(0.005)


def test_a_lasting_slowdown_is_learned_not_skipped_forever():
    """Light traffic, then steps 10x longer for good: after a few skips they count."""
    estimator = StepOverheadEstimator(max_skipped=3)
    for _ in range(5):
        estimator.observe(0.010, 0.010)
    used = [estimator.observe(0.100, 0.010) for _ in range(6)]
    assert used == [False, False, False, True, True, True]
    assert estimator.seconds > 0.02


def test_a_wrong_profile_does_not_make_every_step_an_outlier():
    """Outliers are judged against measured steps, not the profile: a curve 100x too fast
    still yields an estimate (the whole difference)."""
    estimator = StepOverheadEstimator()
    for _ in range(10):
        assert estimator.observe(0.010, 0.0001)
    assert estimator.seconds == pytest.approx(0.0099)


@pytest.mark.parametrize("kwargs", [{"smoothing": 0.0}, {"smoothing": 1.5}, {"outlier_factor": 1.0}])
def test_estimator_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        StepOverheadEstimator(**kwargs)


def test_curve_with_overhead_adds_the_time_everywhere():
    shifted = CPU_CURVE.with_step_overhead(0.02)
    batches = np.array([1, 3, 8, 20, 64, 500])
    np.testing.assert_allclose(shifted.step_time(batches), CPU_CURVE.step_time(batches) + 0.02)
    np.testing.assert_allclose(shifted.over_range(1, 70), 1.0 / (1.0 / CPU_CURVE.over_range(1, 70) + 0.02))
    assert CPU_CURVE.with_step_overhead(0.0) == CPU_CURVE
    faster = CPU_CURVE.with_step_overhead(-0.01)  # a profile slower than the engine
    np.testing.assert_allclose(faster.step_time(batches), CPU_CURVE.step_time(batches) - 0.01)
    for bad in (float("nan"), -CPU_CURVE.min_step_time):
        with pytest.raises(ValueError, match="overhead"):
            CPU_CURVE.with_step_overhead(bad)


def test_drafting_cost_makes_the_policy_verify_more():
    """A fixed per-step cost (the drafter) shrinks the relative price of each verified token,
    so with it the dspark policy keeps drafts it would prune on the target-only curve."""
    confidences = np.full((1, 7), 0.95)
    without = select_verify_lengths(confidences, CPU_CURVE, "dspark")
    with_drafting = select_verify_lengths(confidences, CPU_CURVE.with_step_overhead(0.02), "dspark")
    assert without.tolist() == [3]  # stops before the step-time cliff at B = 8
    assert with_drafting.tolist() == [7]
