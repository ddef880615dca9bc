"""vllm_dspark inside a real, in-process vLLM engine (V1 runner, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import (
    engine_runner,
    engine_scheduler,
    fit_markov_to_transitions,
    generate_ids,
    make_drafter,
    make_llm,
    record_decisions,
    spec_counters,
)
from vllm_dspark.scheduling.overhead import MAX_SCALE, MIN_STEP_FRACTION

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 11, 12, 13, 14], [42, 17, 99], [7, 300, 2, 9, 9, 9, 1, 4], [250, 251]]
MAX_TOKENS = 24
K = 4
# Steps per second falling with batch tokens: verification is cheap at first, then not.
SPS_TABLE = [[1, 100.0], [5, 97.0], [10, 90.0], [15, 70.0], [20, 50.0], [40, 25.0]]
# For tests of the policies' decisions: the curve as given, not corrected by how long this
# machine's steps take (which would make the expected pruning depend on the machine).
AS_GIVEN = {"sps_table": SPS_TABLE, "measure_step_overhead": False}
# For tests of what the drafter's own confidences and lengths do: no n-gram proposals.
DRAFTER_ONLY = {"hybrid_ngram": False}


@pytest.fixture(scope="module")
def baseline(tiny_target: Path) -> list[list[int]]:
    llm = make_llm(tiny_target)
    outputs = generate_ids(llm, PROMPTS, MAX_TOKENS)
    del llm
    return outputs


@pytest.fixture(scope="module")
def fitted_drafter(tiny_target: Path, baseline: list[list[int]], tmp_path_factory) -> Path:
    drafter = make_drafter(tiny_target, tmp_path_factory.mktemp("drafter"))
    fit_markov_to_transitions(drafter, tiny_target, [p + o for p, o in zip(PROMPTS, baseline)])
    return drafter


def spec_config(drafter: Path, k: int = K) -> dict:
    return {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": k}


@pytest.mark.parametrize(
    "plugin_options",
    [{"policy": "fixed"}, {"policy": "fixed", "k": 2}, {"policy": "dspark", "sps_table": SPS_TABLE},
     {"policy": "sla", "sps_table": SPS_TABLE, "min_tokens_per_s": 30.0}],
    ids=["fixed", "fixed-k2", "dspark", "sla"],
)
def test_greedy_outputs_identical(tiny_target, fitted_drafter, baseline, plugin_options):
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": plugin_options})
    decisions = record_decisions(llm)
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    counters = spec_counters(llm)
    assert counters["num_drafts"] > 0
    assert counters["num_accepted_tokens"] > 0, "the fitted drafter should get some drafts accepted"
    verified = [int(v) for d in decisions for v in d.verified]
    if plugin_options.get("k") is not None:
        assert max(verified) <= plugin_options["k"]


def test_per_request_lengths_and_counters(tiny_target, fitted_drafter, baseline):
    options = {"vllm_dspark": {"policy": "dspark", **AS_GIVEN}}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), options)
    decisions = record_decisions(llm)
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    scheduler = engine_scheduler(llm)
    assert decisions
    # Within one step, requests with different confidences verify different lengths.
    assert any(len(set(d.verified.tolist())) > 1 for d in decisions if len(d.verified) > 1)
    for d in decisions:
        # dspark admits (request, position) slots in order of prefix survival, so every
        # kept slot survives at least as likely as every dropped one.
        survival = np.cumprod(d.confidences, axis=1)
        kept = [survival[r, j] for r in range(len(d.req_ids)) for j in range(d.verified[r])]
        dropped = [survival[r, j] for r in range(len(d.req_ids)) for j in range(d.verified[r], d.proposed[r])]
        if kept and dropped:
            assert min(kept) >= max(dropped) - 1e-9
    counters = spec_counters(llm)
    stats = scheduler.controller.stats
    assert stats.verified < stats.proposed, "the policy should prune some drafts here"
    # vLLM's own counter sees the verified drafts, not the proposed ones.
    assert counters["num_draft_tokens"] == stats.verified
    # The plugin's acceptance feedback agrees with vLLM's, and its prediction is finite.
    assert stats.accepted == counters["num_accepted_tokens"]
    assert 0 < stats.predicted_accepted < stats.verified
    assert sum(stats.verified_length_counts) == stats.verified_requests


def test_stats_travel_with_vllm_scheduler_stats_to_prometheus(tiny_target, fitted_drafter):
    """The plugin's counters ride in vLLM's SchedulerStats message (msgpack between the
    engine core and the API server), and the stat logger publishes them per engine."""
    from unittest import mock

    from prometheus_client import CollectorRegistry, generate_latest
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_dspark.integration import metrics

    options = {"vllm_dspark": {"policy": "dspark", "sps_table": SPS_TABLE}}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), options, disable_log_stats=False)
    generate_ids(llm, PROMPTS, MAX_TOKENS)
    scheduler = engine_scheduler(llm)
    stats = scheduler.controller.stats
    message = scheduler.make_stats()  # the engine is idle: the snapshot is attached
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=message))
    received = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    assert metrics.DSparkStats.from_dict(received.vllm_dspark) == stats

    registry = CollectorRegistry()
    with mock.patch.object(metrics, "_collector", None), mock.patch(
        "vllm.v1.metrics.prometheus.get_prometheus_registry", return_value=registry
    ):
        loggers = [metrics.DSparkMetricsLogger(None, engine_index=i) for i in (0, 1)]
        loggers[0].record(received, None, engine_idx=0)
        other = metrics.DSparkStats(policy="dspark", verified=3)
        metrics.attach_stats(received, other)
        loggers[1].record(received, None, engine_idx=1)
        text = generate_latest(registry).decode()
    assert f'vllm_dspark_verified_draft_tokens_total{{engine="0",policy="dspark"}} {float(stats.verified)}' in text
    assert 'vllm_dspark_verified_draft_tokens_total{engine="1",policy="dspark"} 3.0' in text, "engines apart"
    assert f'vllm_dspark_pruned_draft_tokens_total{{engine="0",policy="dspark"}} {float(stats.pruned)}' in text
    assert 'vllm_dspark_verification_budget_bucket{engine="0",le="+Inf",policy="dspark"}' in text
    assert f'vllm_dspark_lm_head_rows_total{{engine="0",policy="dspark"}} {float(stats.lm_head_rows)}' in text
    assert 'vllm_dspark_draft_depth_steps_total{depth="0",engine="0",policy="dspark"}' in text
    assert list(stats.confidence_shifts) == ["greedy"], "live recalibration is on by default"
    shift = stats.confidence_shifts["greedy"][0]
    assert f'vllm_dspark_confidence_logit_shift{{engine="0",mode="greedy",policy="dspark",position="1"}} {shift}' in text


def test_online_recalibration_corrects_miscalibrated_drafts(tiny_target, fitted_drafter, baseline):
    """The fitted drafter's confidences (fitted to transitions, not calibrated) predict
    acceptance badly. Verifying every draft (fixed policy), after one warm-up round the
    recalibrated predictions must track the observed acceptance much better than the raw
    ones, with outputs still exact."""
    errors, shifts = {}, {}
    for recalibrate in (False, True):
        options = {"vllm_dspark": {"policy": "fixed", "recalibrate": recalibrate, "recalibration_rate": 0.6, **DRAFTER_ONLY}}
        llm = make_llm(tiny_target, spec_config(fitted_drafter), options)
        stats = engine_scheduler(llm).controller.stats
        assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline  # warm-up round
        before = (stats.verified, stats.accepted, stats.predicted_accepted)
        assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
        verified, accepted, predicted = (now - then for now, then in zip((stats.verified, stats.accepted, stats.predicted_accepted), before))
        errors[recalibrate] = (predicted - accepted) / verified
        shifts[recalibrate] = stats.confidence_shifts
        del llm
    assert abs(errors[False]) > 0.1, "the fixture drafter should be miscalibrated"
    assert abs(errors[True]) < abs(errors[False]) / 2
    # Under-confident drafts get a positive shift, over-confident ones a negative one.
    assert np.sign(shifts[True]["greedy"][0]) == -np.sign(errors[False])
    assert not shifts[False]


def test_greedy_and_sampled_requests_are_recalibrated_apart(tiny_target, fitted_drafter):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": {"policy": "fixed"}})
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, detokenize=False)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(PROMPTS))]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    scheduler = engine_scheduler(llm)
    assert set(scheduler.controller.stats.confidence_shifts) == {"greedy", "sampled"}
    judged = {mode: int(r.judged.sum()) for mode, r in scheduler.controller.recalibrators.items()}
    assert judged["greedy"] > 0 and judged["sampled"] > 0


def test_sampling_with_draft_probabilities_runs(tiny_target, fitted_drafter):
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": {"policy": "fixed"}})
    outputs = generate_ids(llm, PROMPTS, MAX_TOKENS, temperature=1.0, seed=3)
    assert all(len(o) == MAX_TOKENS for o in outputs)
    assert spec_counters(llm)["num_accepted_tokens"] > 0


def test_smollm2_greedy_identical(smollm2_target, tmp_path):
    from vllm import SamplingParams

    drafter = make_drafter(smollm2_target, tmp_path / "drafter", num_layers=1, block_size=4, markov_rank=16)
    prompts = [
        [{"role": "user", "content": "What is 12 times 7?"}],
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "user", "content": "Name three colours."}],
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def run(spec):
        llm = make_llm(smollm2_target, spec, {"vllm_dspark": {"policy": "dspark", "sps_table": SPS_TABLE}} if spec else None)
        outputs = [list(o.outputs[0].token_ids) for o in llm.chat(prompts, params, use_tqdm=False)]
        counters = spec_counters(llm) if spec else {}
        del llm
        return outputs, counters

    base, _ = run(None)
    spec, counters = run(spec_config(drafter, k=4))
    assert spec == base
    assert counters["num_drafts"] > 0


def test_v1_runner_even_when_v2_is_requested(tiny_target, fitted_drafter, baseline, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    llm = make_llm(tiny_target, spec_config(fitted_drafter))
    assert not llm.llm_engine.vllm_config.use_v2_model_runner
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline


def test_sla_priority_from_request_extra_args(tiny_target, baseline, tmp_path):
    """A request that asks for a higher speed floor gets more of its drafts verified than
    the same request without it (greedy: same drafts and confidences in both runs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Moderate confidences, so that every request has several candidate slots.
    drafter = make_drafter(tiny_target, tmp_path / "drafter")
    fit_markov_to_transitions(drafter, tiny_target, [p + o for p, o in zip(PROMPTS, baseline)], confidence_gain=4.0)

    # Every position drafted: the priority orders the candidates a step has; how deep a step
    # drafts is the throughput decision tested in test_adaptive_drafting.py.
    options = {"vllm_dspark": {"policy": "sla", **AS_GIVEN, **DRAFTER_ONLY, "min_tokens_per_s": 0.0,
                               "adaptive_drafting": False}}

    def mean_verified_per_prompt(floors: dict[int, float]) -> list[float]:
        llm = make_llm(tiny_target, spec_config(drafter), options)
        decisions = record_decisions(llm)
        params = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False,
                           extra_args={"dspark_min_tokens_per_s": floors[i]} if i in floors else None)
            for i in range(len(PROMPTS))
        ]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        per_prompt: dict[int, list[int]] = {}
        for decision in decisions:
            for req_id, verified in zip(decision.req_ids, decision.verified):
                per_prompt.setdefault(int(req_id.split("-")[0]) % len(PROMPTS), []).append(int(verified))
        return [float(np.mean(per_prompt[i])) for i in range(len(PROMPTS))]

    plain = mean_verified_per_prompt({})
    chosen = 0
    prioritised = mean_verified_per_prompt({chosen: 400.0})
    assert prioritised[chosen] > plain[chosen] + 0.5, (plain, prioritised)


def test_nan_confidences_fall_back_safely(tiny_target, fitted_drafter, baseline):
    """NaN confidences (a broken confidence head) are replaced by 0: nothing is verified,
    the engine keeps running and outputs stay exact."""
    options = {"vllm_dspark": {"policy": "dspark", "sps_table": SPS_TABLE, **DRAFTER_ONLY}}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), options)
    runner = engine_runner(llm)
    original = runner.drafter.take_confidences

    def poisoned():
        rows = original()
        return None if rows is None else [[float("nan")] * len(row) for row in rows]

    runner.drafter.take_confidences = poisoned
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    stats = engine_scheduler(llm).controller.stats
    assert stats.invalid_confidences > 0 and stats.verified == 0


def test_dspark_async_admission_runs_through_the_kernel_entry_point(tiny_target, fitted_drafter, baseline, monkeypatch):
    """With kernels enabled the scheduler hands dspark_async's top-budget selection to the
    admission kernel's entry point; here its PyTorch reference on CPU stands in for the GPU."""
    import torch

    from vllm_dspark.integration import scheduler as scheduler_module
    from vllm_dspark.kernels import dispatch
    from vllm_dspark.scheduling.ranking import lengths_of_prefix, rank_candidates

    calls: list[tuple[np.ndarray, int, np.ndarray]] = []
    entry = dispatch.admission_lengths

    def spy(conf, budget, use_kernel=None):
        lengths = entry(conf, budget, use_kernel=False)
        calls.append((conf.numpy().copy(), budget, lengths.numpy().copy()))
        return lengths

    monkeypatch.setattr(scheduler_module, "admission_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(dispatch, "admission_lengths", spy)
    options = {"vllm_dspark": {"policy": "dspark_async", **AS_GIVEN, **DRAFTER_ONLY}}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), options)
    decisions = record_decisions(llm)
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    assert len(calls) > 1, "every step after the first should select on the device path"
    for conf, budget, lengths in calls:
        assert lengths.tolist() == lengths_of_prefix(rank_candidates(conf), budget).tolist()
    verified = [d.verified for d in decisions]
    assert any(0 < v.sum() < v.size * K for v in verified), "budgets should cut some blocks short"


def test_waiting_prompts_count_in_the_pass_size(tiny_target, fitted_drafter):
    """With two sequence slots for five requests, a freed slot admits a waiting prompt into
    the same pass as the verification tokens; the policy must see those tokens in B.
    Every step drafts: whether a step drafts at all is the throughput decision tested in
    test_adaptive_drafting.py, and a step that skips it has no decision to look at."""
    options = {"vllm_dspark": {"policy": "dspark", "sps_table": SPS_TABLE, **DRAFTER_ONLY, "adaptive_drafting": False}}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), options, max_num_seqs=2)
    decisions = record_decisions(llm)
    generate_ids(llm, PROMPTS, MAX_TOKENS)
    base = [d.base_tokens for d in decisions]
    waiting_prompt_lengths = {len(p) for p in PROMPTS[2:]}
    assert waiting_prompt_lengths & set(base), f"no step counted a waiting prompt: {sorted(set(base))}"


@pytest.mark.parametrize("case", ["profile_too_fast", "profile_too_slow", "switched_off"])
def test_scheduler_learns_the_step_time_the_profile_lacks(tiny_target, fitted_drafter, baseline, case):
    """A curve claiming 0.1 ms steps: real steps are slower, so the learned model stretches
    the curve (scale clamped at its bound, the rest an offset) and the policies use it. A
    curve claiming 1 s steps: the model shrinks it, but only down to half the fastest
    profiled step. Off when switched off."""
    table = [[1, 1.0], [64, 0.9]] if case == "profile_too_slow" else [[1, 10000.0], [64, 9000.0]]
    measure = case != "switched_off"
    # Raw confidences: recalibrated ones make this drafter verify (and accept) more per step,
    # which leaves too few steps to learn from in a 24-token run.
    plugin = {"policy": "dspark", "sps_table": table, "measure_step_overhead": measure, "recalibrate": False, **DRAFTER_ONLY}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": plugin})
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    controller = engine_scheduler(llm).controller
    if not measure:
        assert controller.step_time.samples == 0 and controller.policy_curve is controller.curve
        return
    # Most steps teach it something; on a loaded machine the model skips some as outliers.
    assert controller.step_time.samples >= MAX_TOKENS // 3
    stats, fastest = controller.stats, controller.curve.min_step_time
    modelled = stats.step_time_scale * fastest + stats.step_overhead_ms / 1000.0
    if case == "profile_too_fast":
        assert stats.step_time_scale == MAX_SCALE and stats.step_overhead_ms > 0
        assert controller.policy_curve.step_time(8) > 10 * controller.curve.step_time(8)
    else:
        assert stats.step_time_scale < 1.0
        assert modelled == pytest.approx(MIN_STEP_FRACTION * fastest), "clamped at half the fastest profiled step"
        assert controller.policy_curve.step_time(1) == pytest.approx(MIN_STEP_FRACTION * fastest, rel=0.06)


# Prompts that repeat themselves, so the n-gram lookup finds continuations.
REPEATING = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200, 300, 100], [9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("drafting", ["drafting", "never-drafting", "drafter-left-out-for-ngram"])
def test_hybrid_proposals_keep_greedy_outputs_and_are_counted_by_source(tiny_target, fitted_drafter, drafting):
    """With the n-gram lookup on, greedy outputs equal plain decoding's, n-gram drafts are
    verified and accepted (also when the controller plans no drafting at all, and when the
    worker leaves the drafter out because every request's continuation wins), vLLM's
    counters agree with the plugin's, and Prometheus splits the counts by source."""
    from vllm_dspark.scheduling import hybrid
    from vllm_dspark.scheduling.controller import DraftPlan

    plain = generate_ids(make_llm(tiny_target), REPEATING, MAX_TOKENS)
    options = {"policy": "fixed", "hybrid_ngram": True, "ngram_skips_drafter": drafting != "drafting"}
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": options})
    controller = engine_scheduler(llm).controller
    if drafting == "never-drafting":
        controller.plan_drafting = lambda num_requests, with_drafter=None: DraftPlan(0, 0.0)
    elif drafting == "drafter-left-out-for-ngram":
        # Any continuation beats the drafter's 0.5 expected drafts, which pay for its pass
        # (0.1 ms on a 10 ms step) only where some request has none.
        controller._drafter_skip = lambda num_requests, depth: hybrid.DrafterSkip(
            np.ones((2, hybrid.MATCH_BUCKETS, 7)), depth, np.full((hybrid.CONTINUATION_KEYS, 1), 0.5), np.full(1, 0.01), 1e-4)
    assert generate_ids(llm, REPEATING, MAX_TOKENS) == plain
    stats = controller.stats
    counters = spec_counters(llm)
    assert stats.ngram_verified > 0 and stats.ngram_accepted > 0
    assert (stats.ngram_proposed == stats.proposed) == (drafting == "never-drafting"), "the drafter's blocks in play"
    assert (stats.drafter_skipped_steps > 0) == (drafting == "drafter-left-out-for-ngram")
    assert stats.drafting_seconds > 0.0, "the drafter's cost reports still reach the controller"
    assert counters["num_draft_tokens"] == stats.verified
    assert counters["num_accepted_tokens"] == stats.accepted
    from vllm_dspark.integration.metrics import metric_families

    samples = {(s.labels["source"], s.labels["stage"]): s.value for f in metric_families({0: stats})
               if f.name == "vllm_dspark_source_draft_tokens" for s in f.samples}
    assert samples[("ngram", "accepted")] == stats.ngram_accepted
    assert samples[("drafter", "verified")] + samples[("ngram", "verified")] == stats.verified


@pytest.mark.parametrize("admitted", ["none", "every-other"])
def test_requests_admitted_without_the_drafter_verify_continuations_only(tiny_target, fitted_drafter, admitted,
                                                                        monkeypatch):
    """Requests the controller admits without the drafter keep greedy outputs equal to plain
    decoding's, and their tokens stay out of the drafter's context. With none admitted
    with it, the drafter never runs and only n-gram continuations are verified; with every
    other one, the others' drafter blocks are verified (every other step planned without
    drafting, so that context-only proposals meet both kinds of request)."""
    import itertools

    from vllm_dspark.integration.proposer import DSparkProposer
    from vllm_dspark.scheduling.controller import DraftPlan

    plain = generate_ids(make_llm(tiny_target), REPEATING, MAX_TOKENS)
    offered, stored = [], []  # context rows of proposals of no drafts; rows they stored
    propose_context_only, store_context = DSparkProposer.propose_context_only, DSparkProposer._store_context

    def offering(self, context, batch_size, skipped_for_ngram=False):
        rows = context()
        offered.append(len(rows))
        return propose_context_only(self, lambda: rows, batch_size, skipped_for_ngram)

    monkeypatch.setattr(DSparkProposer, "propose_context_only", offering)
    monkeypatch.setattr(DSparkProposer, "_store_context", lambda self, rows: stored.append(len(rows)) or store_context(self, rows))
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": {"policy": "fixed", "hybrid_ngram": True}})
    controller = engine_scheduler(llm).controller
    if admitted == "none":
        controller.admit_drafter = lambda num_requests: False
    else:
        admissions, plans, plan = itertools.count(), itertools.count(), controller.plan_drafting
        controller.admit_drafter = lambda num_requests: next(admissions) % 2 == 1
        controller.plan_drafting = lambda num_requests, with_drafter=None: (
            plan(num_requests, with_drafter) if next(plans) % 2 else DraftPlan(0, 0.0))
    assert generate_ids(llm, REPEATING, MAX_TOKENS) == plain
    stats = controller.stats
    assert stats.ngram_verified > 0 and sum(offered) > 0
    if admitted == "none":
        assert stats.verified == stats.ngram_verified, "no drafter block was verified"
        assert sum(stats.draft_depth_counts[1:]) == 0, "the drafter never ran"
        assert sum(stored) == 0, "no context row was stored"
    else:
        assert 0 < sum(stored) < sum(offered), "only the others' rows were stored"
        assert stats.verified > stats.ngram_verified, "the others verified drafter blocks"


def test_hybrid_off_proposes_no_ngram_drafts(tiny_target, fitted_drafter):
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": {"policy": "fixed", "hybrid_ngram": False}})
    generate_ids(llm, REPEATING, MAX_TOKENS)
    assert engine_scheduler(llm).controller.stats.ngram_proposed == 0


def test_continuations_found_before_drafting_equal_those_after_bookkeeping(tiny_target, fitted_drafter, monkeypatch):
    """The worker looks up continuations before vLLM's bookkeeping (to decide whether the
    drafter runs) and reuses them for the scheduler; looked up again on the batch once the
    step's tokens are written, every step gives the same continuations."""
    from vllm_dspark.integration import vllm_patches
    from vllm_dspark.integration.scheduler import DSparkScheduler

    found, handed = [], []
    before_drafting = vllm_patches.lookup_after_step

    def record_then_miss(runner, sampled):
        result = before_drafting(runner, sampled)
        if result is not None:
            found.append(result[1])
        return None if result is None else (("no request",), result[1])  # the take looks up again

    monkeypatch.setattr(vllm_patches, "lookup_after_step", record_then_miss)
    choose = DSparkScheduler._choose_proposals
    monkeypatch.setattr(DSparkScheduler, "_choose_proposals",
                        lambda self, drafts, confidences, proposals: handed.append(proposals) or choose(self, drafts, confidences, proposals))
    llm = make_llm(tiny_target, spec_config(fitted_drafter), {"vllm_dspark": {"policy": "fixed", "hybrid_ngram": True}})
    from vllm_dspark.scheduling import hybrid

    engine_scheduler(llm).controller._drafter_skip = lambda num_requests, depth: hybrid.DrafterSkip(
        np.ones((2, hybrid.MATCH_BUCKETS, 7)), depth, np.full((hybrid.CONTINUATION_KEYS, 1), 1e9), np.full(1, 0.01), 0.0)
    generate_ids(llm, REPEATING, MAX_TOKENS)
    assert len(found) > 5 and len(found) == len(handed)
    for ours, theirs in zip(found, handed):
        assert ours.matches.tolist() == theirs.matches.tolist() and ours.tokens.tolist() == theirs.tokens.tolist()
