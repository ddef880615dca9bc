"""The verification controller without an engine: the per-step loop the scheduler drives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_dspark.config import PluginOptions
from vllm_dspark.integration import compat
from vllm_dspark.scheduling import SpsCurve, dspark_budget
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.policies import POLICIES, POLICY_TYPES, PolicyStep, decide_lengths, DSparkPolicy
from vllm_dspark.scheduling.sla import MIN_TOKENS_PER_S_ARG, request_floor

CURVE = SpsCurve(points=[(1, 100.0), (4, 95.0), (8, 80.0), (16, 50.0), (64, 10.0)])
TABLE = {"sps_table": CURVE.points, "measure_step_overhead": False}


def step(confidences, greedy=None, **kwargs) -> StepInputs:
    c = np.asarray(confidences, dtype=np.float64)
    rows = len(c)
    return StepInputs(
        req_ids=tuple(f"r{i}" for i in range(rows)),
        confidences=c,
        proposed=np.full(rows, c.shape[1]),
        greedy=np.zeros(rows, dtype=bool) if greedy is None else np.asarray(greedy),
        **kwargs,
    )


def run_step(controller: VerificationController, inputs: StepInputs, accepted, scheduled=None) -> np.ndarray:
    verified = controller.decide(inputs).verified
    controller.step_scheduled(0.0, 0, scheduled)
    controller.observe(np.minimum(np.asarray(accepted), verified) + 1)
    return verified


def test_policy_names_come_from_one_literal() -> None:
    assert tuple(POLICY_TYPES) == POLICIES == ("fixed", "threshold", "dspark", "dspark_async", "sla")
    for name in POLICIES:
        assert POLICY_TYPES[name].name == name


def test_a_policy_needing_a_curve_falls_back_to_fixed_without_one() -> None:
    options = PluginOptions(policy="dspark", sps_profile="auto", k=2)
    controller = VerificationController(options, None)
    assert controller.policy.name == "fixed" and controller.stats.policy == "fixed"
    assert controller.decide(step([[0.1, 0.1, 0.1]])).verified.tolist() == [2]
    assert options.policy == "dspark", "the validated options are not mutated"


def test_the_engine_may_cut_drafts_after_the_decision() -> None:
    """Drafts the engine did not schedule were never judged: they count neither as
    verified nor as rejected."""
    controller = VerificationController(PluginOptions(policy="fixed", recalibrate=True), None)
    inputs = step([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])
    assert controller.decide(inputs).verified.tolist() == [3, 3]
    controller.step_scheduled(0.0, 8, {"r0": 1})  # r1's drafts were all cut
    assert controller.awaiting_outcome() == ("r0", "r1")
    controller.observe(np.array([2, 1]))  # r0 accepted its one draft, r1 emitted one token
    stats = controller.stats
    assert (stats.verified, stats.accepted, stats.proposed) == (1, 1, 6)
    assert stats.verified_length_counts[:2] == [1, 1]
    judged = controller.recalibrators["sampled"].judged
    assert judged.tolist()[:2] == [1, 0], "only r0's first draft was judged"


def test_invalid_and_missing_confidences_verify_nothing() -> None:
    controller = VerificationController(PluginOptions(policy="threshold", threshold=0.1), None)
    verified = controller.decide(step([[np.nan, 0.9], [2.0, 0.9], [0.9, 0.9]], missing=1)).verified
    assert verified.tolist() == [0, 0, 2]
    assert controller.stats.invalid_confidences == 2 and controller.stats.missing_confidences == 1


def test_greedy_and_sampled_requests_are_recalibrated_apart() -> None:
    controller = VerificationController(PluginOptions(policy="fixed", recalibration_rate=0.5), None)
    inputs = step([[0.5, 0.5]] * 4, greedy=[True, True, False, False])
    for _ in range(20):  # greedy requests accept everything, sampled ones nothing
        run_step(controller, inputs, accepted=[2, 2, 0, 0])
    calibrated = controller.decide(inputs).confidences
    assert calibrated[0, 0] > 0.8 and calibrated[2, 0] < 0.2
    controller.refresh_gauges()
    assert controller.stats.confidence_shifts["greedy"][0] > 0 > controller.stats.confidence_shifts["sampled"][0]


def test_dspark_async_plans_each_budget_on_the_previous_step() -> None:
    controller = VerificationController(PluginOptions(policy="dspark_async", recalibrate=False, **TABLE), CURVE)
    rng = np.random.default_rng(0)
    first, second = rng.uniform(0.3, 0.95, (2, 6, 4))
    verified = run_step(controller, step(first), accepted=np.zeros(6, int))
    expected_first = decide_lengths(DSparkPolicy(), PolicyStep(first, CURVE))
    assert verified.tolist() == expected_first.tolist(), "no earlier confidences: the dspark scan"
    verified = run_step(controller, step(second), accepted=np.zeros(6, int))
    assert verified.sum() == min(dspark_budget(first, CURVE), np.count_nonzero(second))


def test_a_prompt_in_the_pass_is_not_charged_to_the_drafts() -> None:
    """A CPU-like linear curve, 30 ms + 2 ms a token: a draft of survival 0.15 beside four
    decoding requests does not pay (4.15 / 40 ms < 4 / 38 ms). With a 200-token prompt in
    the pass, pricing the prompt as part of the step (4.15 / 440 ms > 4 / 438 ms) would
    verify it, and even drafts of 0.05; priced apart, the step decides as without the prompt."""
    linear = SpsCurve(points=[(b, 1000.0 / (30.0 + 2.0 * b)) for b in (1, 64, 512)])
    options = {"sps_table": linear.points, "measure_step_overhead": False, "recalibrate": False}
    c = np.array([[0.15], [0.05], [0.05], [0.05]])
    for prompt, plain in ((0, 0), (200, 0), (200, 3)):
        controller = VerificationController(PluginOptions(policy="dspark", **options), linear)
        inputs = step(c, base_tokens=prompt + plain, plain_requests=plain)
        assert controller.decide(inputs).verified.tolist() == [0, 0, 0, 0], (prompt, plain)
    charged = PolicyStep(controller._recalibrated(c, np.zeros(4, dtype=bool)), linear, 200)
    assert DSparkPolicy().lengths(charged).tolist() == [1, 1, 1, 1], "the prompt charged to the drafts"
    confident = VerificationController(PluginOptions(policy="dspark", **options), linear)
    assert confident.decide(step(np.full((4, 1), 0.5), base_tokens=200)).verified.tolist() == [1, 1, 1, 1]


def test_sla_floors_per_request_override_the_default() -> None:
    controller = VerificationController(PluginOptions(policy="sla", min_tokens_per_s=0.0, **TABLE), CURVE)
    c = np.full((4, 4), 0.6)
    plain = controller.decide(step(c)).verified
    controller.step_scheduled(0.0, 0)
    floors = np.array([400.0, 0.0, 0.0, 0.0])
    prioritised = controller.decide(step(c, min_tokens_per_s=floors)).verified
    assert prioritised[0] > plain[0]


@pytest.mark.parametrize("value", ["abc", None, -1, "nan", "inf", float("nan"), True, [1]])
def test_a_bad_client_floor_falls_back_to_the_default(value) -> None:
    assert request_floor({MIN_TOKENS_PER_S_ARG: value}, 7.0) == 7.0
    with pytest.raises(ValueError, match=MIN_TOKENS_PER_S_ARG):
        request_floor({MIN_TOKENS_PER_S_ARG: value}, 7.0, strict=True)


def test_good_client_floors_are_read() -> None:
    assert request_floor({MIN_TOKENS_PER_S_ARG: "12.5"}, 7.0) == 12.5
    assert request_floor({MIN_TOKENS_PER_S_ARG: 0}, 7.0) == 0.0
    assert request_floor(None, 7.0) == request_floor({"other": 1}, 7.0) == 7.0


def test_step_time_is_learned_only_where_steps_can_be_timed() -> None:
    options = PluginOptions(policy="dspark", sps_table=CURVE.points)
    for can_time, learns in ((True, True), (False, False)):
        controller = VerificationController(options, CURVE, can_time_steps=can_time)
        now = 0.0
        for _ in range(10):
            controller.step_started(now)
            controller.step_scheduled(now, 4)
            now += CURVE.step_time(4) + 0.005
        assert (controller.step_time.samples > 0) == learns
        if learns:
            assert math.isclose(controller.step_time.predict(CURVE.step_time(4)), CURVE.step_time(4) + 0.005, rel_tol=0.01)
            assert controller.policy_curve.step_time(4) == pytest.approx(CURVE.step_time(4) + 0.005, rel=0.05)


def test_vllm_version_check(monkeypatch, caplog) -> None:
    compat.check_vllm_version("0.32.0+cpu")
    monkeypatch.delenv(compat.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedVllmError, match=r"0\.32.*found 0\.33\.1.*VLLM_DSPARK_ALLOW_UNSUPPORTED_VLLM"):
        compat.check_vllm_version("0.33.1")
    monkeypatch.setenv(compat.ALLOW_UNSUPPORTED_ENV, "1")
    compat.check_vllm_version("0.33.1")
    assert "starting anyway" in caplog.text
