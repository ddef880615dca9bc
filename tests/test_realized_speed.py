"""The measured check on speculating (scheduling/realized.py): realized gains per load,
the veto they give the controller, and the way back once speculating pays again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.test_step_time_model import STARTUP_CURVE, serve
from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.realized import (
    LIFT_PROBES,
    MIN_SPECULATIVE_STEPS,
    PROBE_STEPS,
    REFERENCE_INTERVAL,
    REQUEST_MIN_STEPS,
    DrafterRole,
    RealizedSpeed,
    StepRecord,
    load_bucket,
)


def record(requests: int, seconds: float, tokens: int, verified: bool = True, drafting_s: float = 0.0) -> StepRecord:
    return StepRecord(requests, 0.1, verified, seconds=seconds, drafting_s=drafting_s, drafted=drafting_s > 0,
                      tokens=tokens)


def test_load_buckets_are_powers_of_two() -> None:
    assert [load_bucket(r) for r in (1, 2, 3, 4, 7, 8, 16, 63, 64)] == [0, 1, 1, 2, 2, 3, 4, 5, 6]


def test_speculative_steps_slower_per_request_than_plain_ones_veto_that_load_only() -> None:
    check = RealizedSpeed()
    for _ in range(3):
        check.add(record(16, 0.1, 16, verified=False))
        check.add(record(1, 0.1, 1, verified=False))
    for _ in range(int(MIN_SPECULATIVE_STEPS) + 2):
        check.add(record(16, 0.15, 20))  # 1.25 tokens per request in 1.5 plain steps: 0.83x
        check.add(record(1, 0.11, 2))  # 2 tokens in 1.1 plain steps: 1.8x
    gain, error, _ = check.gain(16)
    assert gain == pytest.approx(1.25 / 1.5) and error == pytest.approx(0.0, abs=1e-6)
    assert check.vetoes(16) and check.vetoes(31), "the whole bucket 16-31"
    assert not check.vetoes(1) and not check.vetoes(4), "no plain reference at 4: nothing to compare"


def test_a_drafting_step_without_verification_is_a_reference_less_its_drafting_and_a_cost() -> None:
    """Under steady drafting every step drafts; the ones that verify nothing still show what
    a plain pass costs once the drafter's own time is taken out, and count as speculation
    that earned nothing."""
    check = RealizedSpeed()
    for _ in range(10):
        check.add(record(4, 0.12, 4, verified=False, drafting_s=0.02))
    gain, _, count = check.gain(4)
    assert gain == pytest.approx(0.1 / 0.12) and count > MIN_SPECULATIVE_STEPS
    assert check.vetoes(4)


def test_few_or_noisy_steps_do_not_veto() -> None:
    """At one request a step's gain ranges from a drafted step's cost alone to K + 1 tokens;
    a run of unlucky steps with a mean above 1 must not stop speculating."""
    check = RealizedSpeed()
    for _ in range(2):
        check.add(record(1, 0.1, 1, verified=False))
    for _ in range(int(MIN_SPECULATIVE_STEPS) - 1):
        check.add(record(1, 0.2, 1))
    assert not check.vetoes(1), "too few speculative steps"
    rng = np.random.default_rng(0)
    for tokens in rng.choice([1, 1, 1, 5], size=40):  # mean 2 tokens per 1.6 plain steps: 1.25x
        check.add(record(1, 0.16, int(tokens)))
        assert not check.vetoes(1)


@pytest.mark.parametrize("mean_gain", [0.94, 1.04])
def test_a_small_steady_loss_is_vetoed_a_small_gain_seldom(mean_gain: float) -> None:
    """Four requests, per-step gains spread by 0.3 (acceptance varies from step to step),
    400 speculative steps, 20 seeds: speculating that loses 6% is stopped in every run;
    speculating that gains 4% in at most 3 (with 20 steps of memory instead of 100: 9)."""
    vetoed_runs = 0
    for seed in range(20):
        check = RealizedSpeed()
        for _ in range(2):
            check.add(record(4, 0.1, 4, verified=False))
        vetoed = False
        for gain in np.random.default_rng(seed).normal(mean_gain, 0.3, 400).clip(0.2):
            check.add(record(4, 0.2 / gain, 8))  # 2 tokens per request in 2 / gain plain steps
            vetoed = vetoed or check.vetoes(4)
        vetoed_runs += vetoed
    assert vetoed_runs == 20 if mean_gain < 1.0 else vetoed_runs <= 3


def test_one_lucky_probe_does_not_lift_a_veto_three_that_pay_do() -> None:
    """Under a veto only probes speculate (a drafting step, then one that verifies). A
    probe whose two steps gain 1.3x among probes at 0.8x leaves the load plain; three
    probes in a row that gain 1.2x give speculating back."""
    check = RealizedSpeed()
    for _ in range(2):
        check.add(record(4, 0.1, 4, verified=False))
    for _ in range(int(MIN_SPECULATIVE_STEPS) + 2):
        check.add(record(4, 0.25, 8))  # 2 tokens per request in 2.5 plain steps: 0.8x
    assert check.vetoes(4)

    def probe(gain: float) -> bool:
        for _ in range(int(PROBE_STEPS)):
            check.add(record(4, 0.2 / gain, 8))
        return check.vetoes(4)

    assert all(probe(gain) for gain in [0.8, 1.3, 0.8, 0.8, 1.3, 0.8, 0.8, 0.8])
    assert probe(1.2) and probe(1.2), "two probes that pay are not yet enough"
    assert not probe(1.2)


def per_request_record(seconds: float, tokens: np.ndarray, ids: tuple[str, ...] | None = None) -> StepRecord:
    ids = ids or tuple(f"r{i}" for i in range(len(tokens)))
    return StepRecord(len(tokens), 0.1, True, seconds=seconds, tokens=int(tokens.sum()), request_ids=ids,
                      request_tokens=np.asarray(tokens, dtype=float))


def test_a_load_whose_mean_gains_while_one_request_loses_is_vetoed() -> None:
    """Four requests in steps of 2.5 plain steps: three emit 4 tokens a step (1.6x), one
    emits 2 (0.8x). The mean gains 1.4x; the fourth user is slower than plain decoding,
    and the check stops speculating once it has REQUEST_MIN_STEPS steps to judge."""
    check = RealizedSpeed()
    for _ in range(2):
        check.add(record(4, 0.1, 4, verified=False))
    verdicts = []
    for _ in range(int(REQUEST_MIN_STEPS) + 4):
        check.add(per_request_record(0.25, np.array([4, 4, 4, 2])))
        verdicts.append(check.vetoes(4))
    assert not any(verdicts[: int(REQUEST_MIN_STEPS) - 1]), "too few steps of that request"
    assert verdicts[-1], "the slowest request decides"


def spread_tokens(rng: np.random.Generator, requests: int, laggard: bool) -> np.ndarray:
    """Tokens per request of one step at 0.5 plain steps per token: 1.08x per request on
    average, spread from 0.5x to 2x; with `laggard` the first request gets 0.75x."""
    tokens = rng.choice([1, 1, 2, 2, 3, 4], size=requests).astype(float)
    if laggard:
        tokens[0] = rng.choice([1, 1, 1, 1, 2, 3])
    return tokens


@pytest.mark.parametrize("laggard", [False, True])
def test_sixteen_requests_gaining_are_not_vetoed_one_losing_among_them_is(laggard: bool) -> None:
    """Sixteen requests tested at every step, 20 seeds of 400 steps: where each gains
    1.08x on average no run is vetoed; one request at 0.75x is caught in every run."""
    vetoed_at = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        check = RealizedSpeed()
        for _ in range(2):
            check.add(record(16, 0.1, 16, verified=False))
        for step in range(400):
            check.add(per_request_record(0.2, spread_tokens(rng, 16, laggard)))
            if check.vetoes(16):
                vetoed_at.append(step)
                break
    if laggard:
        assert len(vetoed_at) == 20 and max(vetoed_at) < 100
    else:
        assert not vetoed_at


def test_a_request_that_left_the_load_is_forgotten() -> None:
    """A request losing 0.5x leaves before it can be judged; the requests after it gain,
    and its old gains never veto the load."""
    check = RealizedSpeed()
    for _ in range(2):
        check.add(record(4, 0.1, 4, verified=False))
    for _ in range(int(REQUEST_MIN_STEPS) - 4):
        check.add(per_request_record(0.2, np.array([3, 3, 3, 1]), ("a", "b", "c", "gone")))
    for step in range(200):
        check.add(per_request_record(0.2, np.array([3, 3, 3, 3]), ("a", "b", "c", f"new{step // 50}")))
        assert not check.vetoes(4)
    assert "gone" not in check._buckets[load_bucket(4)].requests


def test_a_step_is_folded_once_both_its_time_and_tokens_are_known() -> None:
    check = RealizedSpeed()
    for _ in range(2):
        check.add(record(2, 0.1, 2, verified=False))
    pending = StepRecord(2, 0.1, True, seconds=0.3)
    check.add(pending)
    assert not pending.folded and check.gain(2) is None
    pending.tokens = 2
    check.add(pending)
    check.add(pending)
    assert pending.folded and check.gain(2)[2] == pytest.approx(1.0), "counted once"


def controller(check: bool, learn_step_time: bool = True, each_request: bool = True) -> VerificationController:
    options = PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points, recalibrate=False, check_realized_speed=check,
                            measure_step_overhead=learn_step_time, check_each_request=each_request)
    return VerificationController(options, STARTUP_CURVE, num_speculative_tokens=7)


@pytest.mark.parametrize("each_request", [True, False])
def test_the_controller_stops_where_one_request_pays_for_the_others_gains(each_request: bool) -> None:
    """Four requests drafting with confidence 0.9: three accept every draft they verify,
    the fourth none (its drafts are calibrated no worse, so no model can tell). The mean
    gains, the fourth user pays each speculative step's cost for one token: with the check
    per request the load goes plain after its REQUEST_MIN_STEPS steps; judged on the mean
    alone it speculates on."""
    ctrl = controller(True, each_request=each_request)
    ids, now, depth, speculative = ("a", "b", "c", "laggard"), 0.0, 7, []
    for _ in range(300):
        ctrl.step_started(now)
        verified = np.zeros(4, dtype=np.int64)
        if depth:
            inputs = StepInputs(ids, np.full((4, depth), 0.9), np.full(4, depth), np.ones(4, bool))
            verified = ctrl.decide(inputs).verified
        tokens = 4 + int(verified.sum())
        ctrl.step_scheduled(now, tokens, num_requests=4)
        ctrl.observe(np.r_[verified[:3] + 1, 1] if depth else None)
        depth = ctrl.plan_drafting(4).depth
        drafting = 0.001 * 4 * depth
        if depth:
            ctrl.observe_drafting(4, depth, 4 * depth, drafting)
        now += STARTUP_CURVE.step_time(tokens) + drafting
        speculative.append(bool(verified.any()))
    late = sum(speculative[200:])
    if each_request:
        assert ctrl.stats.vetoed_steps > 0 and late < 0.2 * 100
    else:
        assert ctrl.stats.vetoed_steps == 0 and late > 0.8 * 100


@pytest.mark.parametrize("requests", [1, 4])
def test_the_controller_stops_speculating_where_verifying_costs_what_no_model_shows(requests: int) -> None:
    """Steps that verify cost 1.5 plain steps more than the profile says (a cost the
    step-time model spreads over all steps, since under steady drafting nearly every step
    verifies), and each request accepts one draft: speculating realizes 2 / 2.5 of plain
    decoding. The model keeps drafting; the check stops it."""
    extra = 1.5 * STARTUP_CURVE.step_time(requests)
    drafting = {check: serve(controller(check), STARTUP_CURVE.step_time, requests, 400, 0.6, lambda _: extra)[200:]
                for check in (True, False)}
    assert sum(d > 0 for d in drafting[False]) > 0.9 * 200, "the model alone drafts"
    assert sum(d > 0 for d in drafting[True]) < 0.05 * 200, "the check keeps the steps plain"


def test_speculating_resumes_once_it_pays_again() -> None:
    """The hidden cost goes away after 400 steps: the probes (which go on under the veto,
    backing off to every 128 steps) measure the new gains and drafting resumes."""
    extra = 1.5 * STARTUP_CURVE.step_time(4)
    depths = serve(controller(True), STARTUP_CURVE.step_time, 4, 1200, 0.6, lambda step: extra if step < 400 else 0.0)
    assert sum(d > 0 for d in depths[200:400]) < 10
    assert sum(d > 0 for d in depths[1000:]) > 0.9 * 200


def test_where_speculating_pays_the_check_never_vetoes() -> None:
    """Verifying costs 0.2 plain steps more than profiled and still returns 2 tokens per
    request (about 1.2x at the depth drafted), the check leaves the model's decisions alone."""
    ctrl = controller(True)
    extra = 0.2 * STARTUP_CURVE.step_time(4)
    depths = serve(ctrl, STARTUP_CURVE.step_time, 4, 400, 0.6, lambda _: extra)
    assert ctrl.stats.vetoed_steps == 0 and sum(d > 0 for d in depths[200:]) > 0.9 * 200


def test_a_vetoed_load_verifies_no_ngram_rows_either() -> None:
    """The veto holds for every source: on a step the check keeps plain, n-gram proposals
    (which need no drafting) are not verified."""
    ctrl = controller(True)
    serve(ctrl, STARTUP_CURVE.step_time, 4, 300, 0.6, lambda _: 1.5 * STARTUP_CURVE.step_time(4))
    plan = ctrl.plan_drafting(4)
    while plan.depth:  # past a probe
        plan = ctrl.plan_drafting(4)
    assert not plan.verifies, "the worker is told: no lookup, nothing will be verified"
    inputs = StepInputs(tuple("abcd"), np.zeros((4, 7)), np.full(4, 5), np.ones(4, bool), ngram_matches=np.full(4, 6))
    assert ctrl.decide(inputs).verified.sum() == 0
    off = controller(False)
    assert off.plan_drafting(4).verifies
    assert off.decide(inputs).verified.sum() > 0, "verified without the check (uniform prior 0.5)"


def serve_hybrid(ctrl: VerificationController, requests: int, steps: int,
                 verifying_extra: Callable[[int], float]) -> list[bool]:
    """Every request has an n-gram continuation on every step after the first (whose
    drafter block, survival 0.05, teaches the controller not to draft); a verifying request
    accepts one draft; a step that verifies costs `verifying_extra(step)` seconds more than
    the profile says. Returns, per step, whether it verified anything. A plan that tells the
    worker the next step verifies nothing (so it looks nothing up) must hold."""
    now, ids, verifies, promised = 0.0, tuple(map(str, range(requests))), [], True
    for step in range(steps):
        ctrl.step_started(now)
        matches = np.full(requests, 0 if step == 0 else 6)
        confidences = np.full((requests, 7), 0.05)
        inputs = StepInputs(ids, confidences, np.full(requests, 7), np.ones(requests, bool), ngram_matches=matches)
        verified = ctrl.decide(inputs).verified
        assert promised or not verified.any(), f"step {step} verified after the plan said it would not"
        tokens = requests + int(verified.sum())
        ctrl.step_scheduled(now, tokens, num_requests=requests)
        ctrl.observe(np.minimum(verified, 1) + 1)
        plan = ctrl.plan_drafting(requests)
        depth, promised = plan.depth, plan.verifies
        drafting = 0.001 * requests * depth
        if depth:
            ctrl.observe_drafting(requests, depth, requests * depth, drafting)
        now += STARTUP_CURVE.step_time(tokens) + drafting + (verifying_extra(step) if verified.any() else 0.0)
        verifies.append(bool(verified.any()))
    return verifies


def test_a_load_where_every_step_verifies_gets_plain_reference_steps(monkeypatch) -> None:
    """With n-gram continuations for every request on every step no step is plain, so the
    check had no reference and could never veto, though verifying realized 2 / 2.5 of plain
    decoding (a cost the model does not see: here its step-time fit is off, at 64 requests
    in the serving frontier it had fitted a scale below 1). Reference steps (one plain step
    after REFERENCE_INTERVAL speculative ones) give it one, and it vetoes."""
    from vllm_dspark.scheduling import realized

    extra = 1.5 * STARTUP_CURVE.step_time(4)
    ctrl = controller(True, learn_step_time=False)
    with_reference = serve_hybrid(ctrl, 4, 600, lambda _: extra)
    assert ctrl.stats.reference_steps >= 1 and ctrl.stats.vetoed_steps > 0
    assert sum(with_reference[300:]) < 0.2 * 300, "the check keeps the load plain"
    monkeypatch.setattr(realized, "REFERENCE_INTERVAL", 10**9)
    without = controller(True, learn_step_time=False)
    assert sum(serve_hybrid(without, 4, 600, lambda _: extra)[300:]) > 0.9 * 300, "no reference: verification goes on"
    assert without.stats.vetoed_steps == 0


def test_reference_steps_cost_a_small_share_where_speculating_pays() -> None:
    """Where verifying n-gram continuations pays (no hidden cost), the check never vetoes
    and the reference steps are about one step in REFERENCE_INTERVAL + 1."""
    from vllm_dspark.scheduling.realized import REFERENCE_INTERVAL

    ctrl = controller(True, learn_step_time=False)
    verifies = serve_hybrid(ctrl, 4, 600, lambda _: 0.0)
    assert ctrl.stats.vetoed_steps == 0
    assert ctrl.stats.reference_steps <= 600 / (REFERENCE_INTERVAL + 1) + 1
    assert sum(verifies[100:]) >= (1 - 1.5 / (REFERENCE_INTERVAL + 1)) * 500


def test_a_veto_lifts_where_ngram_continuations_pay_though_drafting_would_not() -> None:
    """Verifying costs 1.5 plain steps more than profiled for the first 300 steps (the load
    is vetoed) and 0.6 after, when verifying each request's n-gram continuation realizes
    about 1.14x a plain step per request, while a drafter pass costs 11% of a plain step for
    drafts that survive 5%. The probes under the veto test what the model would do, verify
    the continuations without drafting, and the veto lifts. Probes that drafted one position
    each (the earlier rule) gained about 1.02x over their two steps and held the veto."""
    ctrl = controller(True, learn_step_time=False)
    plain = STARTUP_CURVE.step_time(4)
    verifies = serve_hybrid(ctrl, 4, 1600, lambda step: (1.5 if step < 300 else 0.6) * plain)
    assert sum(verifies[200:300]) < 0.2 * 100, "vetoed while verifying costs more than it gains"
    assert sum(verifies[1300:]) > 0.9 * 300, "verifying again once it pays"


def hybrid_record(seconds: float, tokens: int, drafter: bool = False, kept_plain: bool = False,
                  role: DrafterRole = DrafterRole.AS_DECIDED) -> StepRecord:
    """A step at four requests whose plain pass is profiled at 0.1 s; `drafter`: the
    drafter ran in it and its drafts were verified."""
    return StepRecord(4, 0.1, tokens > 4, seconds=seconds, drafting_s=0.02 if drafter else 0.0, drafted=drafter,
                      verified_drafter=drafter, tokens=tokens, kept_plain=kept_plain, drafter_role=role)


def reference_pair(hybrid_tokens: int) -> list[StepRecord]:
    """A reference for the drafter's check as the controller plans it: the step before
    verifies the drafter's drafts, the step after drafts (both at `hybrid_tokens`, counted
    nowhere), the reference between them gains 6 tokens in a plain step's time (1.5x)."""
    beside = DrafterRole.BESIDE_REFERENCE
    return [hybrid_record(0.11, hybrid_tokens, role=beside), hybrid_record(0.1, 6, role=DrafterRole.REFERENCE),
            hybrid_record(0.12, 4, role=beside)]


@pytest.mark.parametrize("drafter_tokens, vetoed", [(6, True), (8, False)])
def test_a_drafter_that_brings_less_than_its_cost_over_ngram_is_vetoed_alone(drafter_tokens: int, vetoed: bool) -> None:
    """Without the drafter the steps realize 1.5x plain; steps with it take 1.3 plain
    steps: with 6 tokens (1.15x) the drafter is vetoed, n-gram proposals not (both beat
    plain decoding); with 8 (1.54x) it drafts on. The check's own plain steps (here at
    1.0x) and the steps beside a reference sample neither side."""
    check = RealizedSpeed(drafter_against_ngram=True)
    for _ in range(3):
        check.add(hybrid_record(0.1, 4))
    for _ in range(int(MIN_SPECULATIVE_STEPS) + 2):
        for record in reference_pair(hybrid_tokens=12):
            check.add(record)
        for _ in range(3):
            check.add(hybrid_record(0.1, 4, kept_plain=True))
        check.add(hybrid_record(0.13, drafter_tokens, drafter=True))
    assert check.drafter_vetoes(4) is vetoed
    assert not check.vetoes(4), "speculating pays: the load is not kept plain"


def test_steps_the_drafter_skip_chose_count_for_the_hybrid_not_as_its_reference() -> None:
    """The skip leaves the drafter out where copying serves most (here about 1.9x), and
    the drafter runs where it does not (1.35x): the hybrid as decided, about 1.6x, beats
    the references without the drafter (1.5x), so the drafter stays. Judged against the
    skipped steps, as the first version did, it would be vetoed."""
    check = RealizedSpeed(drafter_against_ngram=True)
    for _ in range(3):
        check.add(hybrid_record(0.1, 4))
    for _ in range(4 * int(MIN_SPECULATIVE_STEPS)):
        for record in reference_pair(hybrid_tokens=4):
            check.add(record)
        for step in range(4):
            check.add(hybrid_record(0.1, 8 - step % 2))  # skipped: 7-8 tokens, about 1.9x
            check.add(hybrid_record(0.13, 7, drafter=True))  # 7 tokens in 1.3 steps: 1.35x
        assert not check.drafter_vetoes(4)


def test_three_probes_that_pay_bring_the_drafter_back() -> None:
    """Under the veto the steps between probes are the reference: n-gram alone, by count."""
    check = RealizedSpeed(drafter_against_ngram=True)
    for _ in range(3):
        check.add(hybrid_record(0.1, 4))
    for _ in range(int(MIN_SPECULATIVE_STEPS) + 2):
        for record in reference_pair(hybrid_tokens=6):
            check.add(record)
        check.add(hybrid_record(0.13, 6, drafter=True))
    assert check.drafter_vetoes(4)
    for probe in range(int(LIFT_PROBES)):
        for _ in range(int(PROBE_STEPS)):
            check.add(hybrid_record(0.1, 6))
            check.add(hybrid_record(0.11, 8, drafter=True))  # 1.65x: now the drafter pays
        assert check.drafter_vetoes(4) is (probe < LIFT_PROBES - 1)


def test_the_hybrid_asks_for_a_reference_without_the_drafter_once_per_interval() -> None:
    check = RealizedSpeed(drafter_against_ngram=True)
    check.add(hybrid_record(0.1, 4, kept_plain=True))  # the load's own reference
    for step in range(REFERENCE_INTERVAL - 1):
        check.add(hybrid_record(0.13, 8, drafter=bool(step % 2)))  # drafted or skipped: the hybrid
        assert not check.drafter_reference_due(4)
    check.add(hybrid_record(0.13, 8, drafter=True))
    assert check.drafter_reference_due(4) and not check.drafter_reference_due(4), "once"


def serve_two_sources(ctrl: VerificationController, steps: int, drafting_per_position: float) -> list[tuple[int, bool]]:
    """Four requests: two have an n-gram continuation on every step, two only the
    drafter's block (confidence 0.8, which the controller, recalibration off, believes);
    every verifying request accepts one draft. Drafting costs `drafting_per_position`
    seconds per request and position. Returns, per step, the planned depth and whether
    n-gram rows were verified."""
    now, depth, ids, out = 0.0, 0, tuple("abcd"), []
    matches = np.array([6, 6, 0, 0])
    for _ in range(steps):
        ctrl.step_started(now)
        proposed = np.array([5, 5, depth, depth])
        confidences = np.full((4, 7), 0.8)
        inputs = StepInputs(ids, confidences, proposed, np.ones(4, bool), ngram_matches=matches)
        verified = ctrl.decide(inputs).verified
        tokens = 4 + int(verified.sum())
        ctrl.step_scheduled(now, tokens, num_requests=4)
        ctrl.observe(np.minimum(verified, 1) + 1)
        ngram_verified = bool(verified[:2].any())
        depth = ctrl.plan_drafting(4).depth
        drafting = drafting_per_position * 4 * depth
        if depth:
            ctrl.observe_drafting(4, depth, 4 * depth, drafting)
        now += STARTUP_CURVE.step_time(tokens) + drafting
        out.append((depth, ngram_verified))
    return out


def hybrid_controller(check_drafter: bool) -> VerificationController:
    """Judged on the mean over requests: without the drafter, its two requests here pay
    for the n-gram rows' verification with no gain, which the check per request vetoes."""
    options = PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points, recalibrate=False, hybrid_ngram=True,
                            check_drafter_against_ngram=check_drafter, check_each_request=False)
    return VerificationController(options, STARTUP_CURVE, num_speculative_tokens=7)


def test_the_hybrid_stops_drafting_where_ngram_alone_is_faster_and_keeps_verifying_it() -> None:
    """The drafter's two requests gain one token each per drafting step, which costs more
    than that (its model counts all four requests as the drafter's): with the check the
    steps go on verifying n-gram continuations without drafting; without it they draft."""
    for check_drafter in (True, False):
        ctrl = hybrid_controller(check_drafter)
        late = serve_two_sources(ctrl, 600, 0.004)[300:]
        drafting = sum(depth > 0 for depth, _ in late)
        assert sum(ngram for _, ngram in late) > 0.9 * len(late), "n-gram continuations verified"
        assert ctrl.stats.vetoed_steps == 0
        if check_drafter:
            assert ctrl.stats.drafter_vetoed_steps > 0 and drafting < 0.2 * len(late)
        else:
            assert drafting > 0.8 * len(late)


def test_where_the_drafter_pays_beside_ngram_the_hybrid_drafts_on() -> None:
    ctrl = hybrid_controller(True)
    late = serve_two_sources(ctrl, 600, 0.0002)[300:]
    assert ctrl.stats.drafter_vetoed_steps == 0
    assert sum(depth > 0 for depth, _ in late) > 0.85 * len(late)
    assert ctrl.stats.drafter_reference_steps <= 2 * (600 / REFERENCE_INTERVAL + 1)


def test_the_reference_step_neither_drafts_nor_verifies_the_drafters_drafts() -> None:
    """Around each pair of steps left without the drafter, the records the check folds read
    beside / reference / beside: only the reference is free of the drafter's work."""
    ctrl = hybrid_controller(True)
    records: list[StepRecord] = []
    fold = ctrl.realized.add

    def spy(record: StepRecord) -> None:
        already = record.folded
        fold(record)
        if record.folded and not already:
            records.append(record)

    ctrl.realized.add = spy
    serve_two_sources(ctrl, 300, 0.0002)
    roles = [record.drafter_role for record in records]
    references = [i for i, role in enumerate(roles) if role is DrafterRole.REFERENCE]
    assert len(references) >= 4
    for i in references:
        assert roles[i - 1] is roles[i + 1] is DrafterRole.BESIDE_REFERENCE
    assert not any(records[i].drafted or records[i].verified_drafter for i in references)
    # The step before does not draft, the step after verifies none of the drafter's drafts.
    assert not any(records[i - 1].drafted or records[i + 1].verified_drafter for i in references)
