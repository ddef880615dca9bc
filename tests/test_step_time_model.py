"""The step time the SPS profile does not predict: the learned model (scale and offset),
its effect on the curve the policies use, and why it needs both."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import SpsCurve, select_verify_lengths
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.overhead import MAX_SCALE, MIN_STEP_FRACTION, StepTimeModel, applied_model

# The SmolLM2 CPU profile measured here (benchmarks/results/sps_smollm2_cpu.json, rounded).
CPU_CURVE = SpsCurve(points=[(1, 29.4), (2, 24.8), (4, 24.8), (8, 13.2), (16, 13.2), (32, 10.2), (64, 5.7)])
# The start-up profile of the served engine (benchmarks/results/sps_smollm2_cpu_startup.json).
STARTUP_CURVE = SpsCurve(points=[(1, 27.04), (4, 27.04), (16, 18.57), (64, 6.34)])


def fed(model: StepTimeModel, profiled: np.ndarray, measured: np.ndarray) -> StepTimeModel:
    for x, y in zip(profiled, measured):
        assert model.observe(float(y), float(x))
    return model


def test_one_step_size_is_explained_half_by_scale_half_by_offset():
    model = fed(StepTimeModel(), np.full(30, 0.050), np.full(30, 0.110))
    assert model.predict(0.050) == pytest.approx(0.110, rel=0.01)
    assert (model.scale - 1.0) * 0.050 == pytest.approx(model.offset, rel=1e-6)


@pytest.mark.parametrize("scale, offset", [(2.0, 0.005), (1.0, 0.010), (0.7, 0.0)])
def test_varied_steps_tell_scale_from_offset(scale, offset):
    profiled = np.tile([0.030, 0.050, 0.090, 0.150], 20)
    model = fed(StepTimeModel(), profiled, scale * profiled + offset)
    assert model.scale == pytest.approx(scale, abs=0.05)
    assert model.offset == pytest.approx(offset, abs=0.002)


def test_first_step_then_forgetting():
    model = StepTimeModel(smoothing=0.5)
    fed(model, np.tile([0.01, 0.02], 10), np.tile([0.02, 0.04], 10))  # twice the profile
    assert model.scale == pytest.approx(2.0, abs=0.05)
    fed(model, np.tile([0.01, 0.02], 10), np.tile([0.01, 0.02], 10))  # now the profile itself
    assert model.scale == pytest.approx(1.0, abs=0.02) and abs(model.offset) < 5e-4


def test_stalls_and_bad_intervals_are_skipped():
    model = StepTimeModel(outlier_factor=4.0)
    assert model.observe(0.015, 0.010)
    assert not model.observe(0.5, 0.010), "a stall is not a step"
    assert not model.observe(0.0, 0.010) and not model.observe(0.01, 0.0)
    assert model.samples == 1 and model.predict(0.010) == pytest.approx(0.015, rel=0.01)


def test_a_lasting_slowdown_is_learned_not_skipped_forever():
    """Light traffic, then steps 10x longer for good: after a few skips they count."""
    model = StepTimeModel(max_skipped=3)
    fed(model, np.full(5, 0.010), np.full(5, 0.010))
    used = [model.observe(0.100, 0.010) for _ in range(6)]
    assert used == [False, False, False, True, True, True]
    assert model.predict(0.010) == pytest.approx(0.100, rel=0.02), "the old regime is forgotten"


def test_a_wrong_profile_does_not_make_every_step_an_outlier():
    """Outliers are judged against measured steps, not the profile: a curve 100x too fast
    still yields a model of the whole difference (the scale clamped, the offset the rest)."""
    model = fed(StepTimeModel(), np.full(10, 0.0001), np.full(10, 0.010))
    assert model.scale == MAX_SCALE
    assert model.predict(0.0001) == pytest.approx(0.010, rel=0.03)


@pytest.mark.parametrize("kwargs", [{"smoothing": 0.0}, {"smoothing": 1.5}, {"ridge": 0.0}, {"outlier_factor": 1.0}])
def test_model_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        StepTimeModel(**kwargs)


def test_curve_with_a_step_model_maps_every_step():
    batches = np.array([1, 3, 8, 20, 64, 500])
    mapped = CPU_CURVE.with_step_model(1.5, 0.02)
    np.testing.assert_allclose(mapped.step_time(batches), 1.5 * CPU_CURVE.step_time(batches) + 0.02)
    np.testing.assert_allclose(mapped.over_range(1, 70), 1.0 / (1.5 / CPU_CURVE.over_range(1, 70) + 0.02))
    assert CPU_CURVE.with_step_model(1.0, 0.0) == CPU_CURVE
    for scale, offset in ((float("nan"), 0.0), (0.0, 0.01), (1.0, -CPU_CURVE.min_step_time), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="step model"):
            CPU_CURVE.with_step_model(scale, offset)


def test_applied_model_keeps_half_the_fastest_step():
    scale, offset = applied_model(CPU_CURVE, 1.2, -1.0)
    assert scale == 1.2
    assert scale * CPU_CURVE.min_step_time + offset == pytest.approx(MIN_STEP_FRACTION * CPU_CURVE.min_step_time)
    assert applied_model(CPU_CURVE, 2.0, 0.003) == (2.0, 0.003)


def test_drafting_cost_makes_the_policy_verify_more():
    """A fixed per-step cost (the drafter) shrinks the relative price of each verified token,
    so with it the dspark policy keeps drafts it would prune on the target-only curve."""
    confidences = np.full((1, 7), 0.95)
    without = select_verify_lengths(confidences, CPU_CURVE, "dspark")
    with_drafting = select_verify_lengths(confidences, CPU_CURVE.with_step_model(1.0, 0.02), "dspark")
    assert without.tolist() == [3]  # stops before the step-time cliff at B = 8
    assert with_drafting.tolist() == [7]


def test_a_slower_engine_is_not_a_cheaper_token():
    """Steps twice the profile at 16 requests, explained as a scale, keep the verified
    tokens as dear as the profile says; explained as an offset they look cheap and the
    policy verifies more. Both predict the same step at the current load."""
    confidences = np.tile([0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3], (16, 1))
    extra = STARTUP_CURVE.step_time(16)
    as_scale = select_verify_lengths(confidences, STARTUP_CURVE.with_step_model(2.0, 0.0), "dspark")
    as_offset = select_verify_lengths(confidences, STARTUP_CURVE.with_step_model(1.0, extra), "dspark")
    assert as_scale.sum() < as_offset.sum()


def serve(controller: VerificationController, step_time, requests: int, steps: int, survival: float,
          verifying_extra=lambda step: 0.0) -> list[int]:
    """Drive the controller as the engine does on a clock: each step takes
    step_time(tokens in the pass) plus its drafting (1 ms per request and position), plus
    `verifying_extra(step)` seconds when it verifies drafts (a cost no profile shows). Each
    verifying request accepts one draft."""
    now, depth, depths = 0.0, 7, []
    for step in range(steps):
        controller.step_started(now)
        verified = np.zeros(requests, dtype=np.int64)
        if depth:
            c = np.full((requests, depth), survival)
            inputs = StepInputs(tuple(map(str, range(requests))), c, np.full(requests, depth), np.zeros(requests, bool))
            verified = controller.decide(inputs).verified
        tokens = requests + int(verified.sum())
        controller.step_scheduled(now, tokens, num_requests=requests)
        controller.observe(np.minimum(verified, 1) + 1 if depth else None)
        depth = controller.plan_drafting(requests).depth
        drafting = 0.001 * requests * depth
        if depth:
            controller.observe_drafting(requests, depth, requests * depth, drafting)
        now += step_time(tokens) + drafting + (verifying_extra(step) if verified.any() else 0.0)
        depths.append(depth)
    return depths


def test_the_controller_stops_drafting_on_an_engine_slower_in_proportion():
    """The served engine's steps are 2.3x the start-up profile (`vllm bench serve` at 16
    users on this CPU). Drafts that survive 45% of the time pay for a step that is the
    profile plus a constant, not for one that is the profile times a factor: the controller
    learns which engine it is on from the steps it times and drafts accordingly."""
    options = PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points, recalibrate=False)
    extra = 1.3 * STARTUP_CURVE.step_time(16)
    runs = {
        name: serve(VerificationController(options, STARTUP_CURVE, num_speculative_tokens=7), step_time, 16, 200, 0.45)[100:]
        for name, step_time in [
            ("scaled", lambda tokens: 2.3 * STARTUP_CURVE.step_time(tokens)),
            ("shifted", lambda tokens: STARTUP_CURVE.step_time(tokens) + extra),
        ]
    }
    assert runs["scaled"].count(0) > 0.8 * len(runs["scaled"]), "plain decoding wins on the scaled engine"
    assert runs["shifted"].count(0) < 0.2 * len(runs["shifted"]), "drafting pays on the shifted one"


def test_steps_with_prompt_tokens_are_not_timed():
    """A pass of prompts lies beyond the decode profile: it would teach the model the most
    (leverage) and the least (an extrapolated step time)."""
    options = PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points)
    controller = VerificationController(options, STARTUP_CURVE, num_speculative_tokens=7)
    now = 0.0
    for step in range(10):
        prefill = 2048 if step % 2 else 0
        controller.step_started(now)
        controller.step_scheduled(now, 16 + prefill, prefill_tokens=prefill)
        now += 2.0 * STARTUP_CURVE.step_time(16) if not prefill else 0.5
    assert controller.step_time.samples == 5, "only the decode steps teach the model"
    assert controller.step_time.predict(STARTUP_CURVE.step_time(16)) == pytest.approx(2.0 * STARTUP_CURVE.step_time(16), rel=0.01)
