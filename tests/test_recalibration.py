"""Online recalibration of confidences from observed acceptance (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark
from vllm_dspark.scheduling.recalibration import OnlineRecalibrator


def test_starts_as_identity_and_keeps_missing_confidences_at_zero():
    recalibrator = OnlineRecalibrator()
    c = np.array([[0.9, 0.5, 0.0], [0.2, 0.0, 0.0]])
    assert np.allclose(recalibrator.apply(c), c, atol=1e-9)
    assert recalibrator.apply(c)[0, 2] == 0.0


def test_judged_positions_follow_the_verification_outcome():
    """Verified 3, accepted 1: position 1 accepted, 2 rejected, 3 never judged."""
    recalibrator = OnlineRecalibrator(learning_rate=0.5, prior_pull=0.0)
    recalibrator.observe(np.full((1, 3), 0.5), np.array([3]), np.array([1]))
    assert recalibrator.judged.tolist() == [1, 1, 0]
    assert recalibrator.shifts[0] == pytest.approx(0.25)  # -lr * (0.5 - 1)
    assert recalibrator.shifts[1] == pytest.approx(-0.25)  # -lr * (0.5 - 0)
    assert recalibrator.shifts[2] == 0.0


def test_all_accepted_judges_every_verified_position_and_nothing_beyond():
    recalibrator = OnlineRecalibrator(prior_pull=0.0)
    recalibrator.observe(np.full((2, 4), 0.5), np.array([2, 0]), np.array([2, 0]))
    assert recalibrator.judged.tolist() == [1, 1, 0, 0]
    assert (recalibrator.shifts[:2] > 0).all() and (recalibrator.shifts[2:] == 0).all()


def _simulate(claimed: float, true_rate: float, steps: int = 600, requests: int = 8, width: int = 4) -> OnlineRecalibrator:
    """A drafter that always claims `claimed`; each draft survives with `true_rate` given
    its prefix survived; every draft is verified."""
    rng = np.random.default_rng(0)
    recalibrator = OnlineRecalibrator()
    confidences = np.full((requests, width), claimed)
    verified = np.full(requests, width)
    for _ in range(steps):
        survives = rng.random((requests, width)) < true_rate
        accepted = np.where(survives.all(axis=1), width, survives.argmin(axis=1))
        recalibrator.observe(confidences, verified, accepted)
    return recalibrator


@pytest.mark.parametrize(("claimed", "true_rate"), [(0.9, 0.4), (0.1, 0.6), (0.5, 0.5)])
def test_converges_to_the_observed_conditional_acceptance(claimed, true_rate):
    recalibrator = _simulate(claimed, true_rate)
    calibrated = recalibrator.apply(np.full((1, 4), claimed))[0]
    # Positions judged often converge closely; deep ones (rarely reached) are noisier but
    # move the right way, and a calibrated drafter stays about calibrated.
    assert calibrated[0] == pytest.approx(true_rate, abs=0.05)
    assert calibrated[1] == pytest.approx(true_rate, abs=0.08)
    assert np.all(np.abs(calibrated - true_rate) <= max(abs(claimed - true_rate) / 2, 0.1))


def test_without_evidence_shifts_drift_back_to_the_offline_calibration():
    recalibrator = _simulate(0.9, 0.4, steps=200)
    before = recalibrator.shifts.copy()
    assert before[0] < -1.0
    for _ in range(100):  # the policy verifies nothing: no position is judged
        recalibrator.observe(np.full((8, 4), 0.9), np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64))
    assert np.all(np.abs(recalibrator.shifts) < np.abs(before) * 0.5)


def test_shifts_are_bounded_and_zero_confidences_teach_nothing():
    recalibrator = OnlineRecalibrator(learning_rate=1.0, max_shift=2.0, prior_pull=0.0)
    for _ in range(50):
        recalibrator.observe(np.array([[0.99, 0.0]]), np.array([2]), np.array([0]))
    assert recalibrator.shifts[0] == pytest.approx(-2.0)
    assert recalibrator.judged.tolist() == [50, 0]


@pytest.mark.parametrize(
    "kwargs", [{"learning_rate": 0.0}, {"learning_rate": 1.5}, {"max_shift": 0.0}, {"prior_pull": 1.0}]
)
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        OnlineRecalibrator(**kwargs)


def _load_simulator():
    return load_benchmark("simulate_scheduling")


def test_simulator_recalibration_recovers_throughput_lost_to_over_confidence():
    """The simulator's study in miniature: over-confident drafts cost dspark throughput on
    the CPU curve, and the online recalibration wins most of it back."""
    sim = _load_simulator()
    trace = sim.synthetic_trace(num_requests=200, block=7, seed=1)
    assert np.allclose(sim.distort(trace, 1.0, 0.0).confidences, trace.confidences, atol=1e-5)
    over = sim.distort(trace, 1.0, 2.0)
    curve = sim.cpu_curve()
    dspark = {"policy": "dspark"}
    calibrated = sim.simulate(trace, curve, 8, dspark, 0.0)["throughput"]
    raw = sim.simulate(over, curve, 8, dspark, 0.0)["throughput"]
    recalibrated = sim.simulate(over, curve, 8, dspark, 0.0, recalibrate=True)["throughput"]
    assert raw < 0.97 * calibrated
    assert recalibrated - raw > 0.5 * (calibrated - raw)
