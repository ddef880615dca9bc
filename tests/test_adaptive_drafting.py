"""Drafting that pays for itself: whether and how deep to draft, the drafter's early stop,
the reduced draft vocabulary and the out-of-the-box start-up profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import (
    engine_runner,
    engine_scheduler,
    fit_markov_to_transitions,
    generate_ids,
    make_drafter,
    make_llm,
    spec_counters,
)
from vllm_dspark.config import ConfigError, DrafterConfig, PluginOptions
from vllm_dspark.integration.deferred_context import ContextRows, DeferredContext, last_writes_only
from vllm_dspark.model.drafter import DSparkDrafter, target_ids_of
from vllm_dspark.model.heads import sequential_draft
from vllm_dspark.model.reduce_vocab import choose_draft_vocab, coverage, reduce_drafter
from vllm_dspark.scheduling import SpsCurve
from vllm_dspark.scheduling.controller import MAX_PROBE_INTERVAL, PROBE_INTERVAL, StepInputs, VerificationController

K = 4
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 11, 12, 13, 14], [42, 17, 99], [7, 300, 2, 9, 9, 9, 1, 4]]
MAX_TOKENS = 24


# ------------------------------------------------------------ whether and how deep


def linear_drafting(depth: int) -> float:
    """5 ms context pass, 20 ms per drafted position."""
    return 0.005 + 0.02 * depth


def flat_drafting(depth: int) -> float:
    """1 ms context pass, 14 ms more once the drafter runs at all, whatever the depth."""
    return 0.001 + 0.014 * (depth > 0)


def run_steps(controller: VerificationController, survival: float, steps: int, requests: int = 8, depth: int = K,
              stopped_after: int = K, cut_to: int = K, drafting_seconds=linear_drafting) -> list[int]:
    """Drive the controller as the engine does, drafting what it plans (from `depth` on);
    every draft has confidence `survival` and drafting a depth costs
    `drafting_seconds(depth)`. The drafter stops every request early after `stopped_after`
    positions (confidence 0 in the slots after); the engine cuts the drafts to `cut_to`
    (the end of max_tokens)."""
    depths = []
    for _ in range(steps):
        if depth:
            c = np.full((requests, depth), survival)
            c[:, stopped_after:] = 0.0
            proposed = np.full(requests, min(depth, cut_to))
            c[:, proposed[0]:] = 0.0
            inputs = StepInputs(tuple(map(str, range(requests))), c, proposed, np.zeros(requests, bool))
            verified = controller.decide(inputs).verified
        controller.step_scheduled(0.0, 0)
        controller.observe(np.minimum(verified, 1) + 1 if depth else None)
        controller.observe_drafting(requests, depth, requests * depth, drafting_seconds(depth))
        depth = controller.plan_drafting(requests).depth
        depths.append(depth)
    return depths


# The policies whose drafting depth the controller chooses; sla with floors no step can
# meet (overload: it takes only throughput-raising drafts) and with floors plain decoding
# already meets.
ADAPTIVE_POLICIES = {
    "dspark": {"policy": "dspark"},
    "dspark, per-user objective": {"policy": "dspark", "objective": "per_user"},
    "sla, unmet floors": {"policy": "sla", "min_tokens_per_s": 1000.0},
    "sla, met floors": {"policy": "sla", "min_tokens_per_s": 0.5},
}


def controller_on(curve: SpsCurve, policy: str = "dspark") -> VerificationController:
    options = PluginOptions(**ADAPTIVE_POLICIES[policy], sps_table=curve.points, measure_step_overhead=False, recalibrate=False)
    return VerificationController(options, curve, num_speculative_tokens=K)


@pytest.mark.parametrize("policy", ADAPTIVE_POLICIES)
def test_stops_drafting_where_it_never_pays_and_probes_now_and_then(policy: str) -> None:
    # Verification is expensive and drafts are rarely right: plain decoding wins.
    steep = SpsCurve(points=[(1, 20.0), (8, 18.0), (16, 5.0), (64, 1.0)])
    depths = run_steps(controller_on(steep, policy), survival=0.05, steps=3 * PROBE_INTERVAL)
    settled = depths[5:]
    assert settled.count(0) > 0.85 * len(settled)
    assert set(settled) <= {0, 1}, "probes draft a single position"
    assert 1 in settled, "a probe now and then keeps the survival estimate fresh"


def test_probes_back_off_while_drafting_loses_and_drafting_resumes_once_it_pays() -> None:
    # One position pays on this curve if drafts survive (8 x 1.95 tokens at 15 steps/s plus
    # 25 ms of drafting beat 8 at 18), not while they rarely do.
    curve = SpsCurve(points=[(1, 20.0), (8, 18.0), (16, 15.0), (64, 5.0)])
    controller = controller_on(curve)
    losing = run_steps(controller, survival=0.05, steps=8 * MAX_PROBE_INTERVAL)
    probes = [step for step, depth in enumerate(losing) if depth > 0 and step > K]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    doubling = [min(PROBE_INTERVAL * 2 ** (i + 1), MAX_PROBE_INTERVAL) for i in range(len(gaps))]
    assert gaps == doubling and gaps[-1] == MAX_PROBE_INTERVAL
    paying = run_steps(controller, survival=0.95, steps=2 * MAX_PROBE_INTERVAL, depth=losing[-1])
    resumed = paying.index(1)
    assert resumed < MAX_PROBE_INTERVAL, "the next probe finds drafting paying"
    later = paying[resumed + 1:]
    assert later.count(0) <= len(later) // PROBE_INTERVAL + 1, "back to the base probe rate"


def test_each_load_backs_off_its_own_probes() -> None:
    """Waves pass through loads: here runs of 4 steps at one request, where drafting all K
    pays, alternate with runs of 4 at 16, where verification is dear and it does not. The
    probes at 16 back off to every MAX_PROBE_INTERVAL of its steps; with one clock for all
    loads, each run at one request reset the wait to PROBE_INTERVAL."""
    curve = SpsCurve(points=[(1, 20.0), (16, 19.0), (32, 6.0), (64, 3.0)])
    controller, depth, light, heavy = controller_on(curve), K, [], []
    for _ in range(160):
        light += run_steps(controller, survival=0.6, steps=4, requests=1, depth=depth, drafting_seconds=flat_drafting)
        heavy += run_steps(controller, survival=0.6, steps=4, requests=16, depth=light[-1],
                           drafting_seconds=flat_drafting)
        depth = heavy[-1]
    assert light[40:].count(K) > 0.9 * len(light[40:]), "drafting pays at one request"
    probes = [step for step, d in enumerate(heavy) if d > 0 and step > 8]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-2:] == [MAX_PROBE_INTERVAL] * 2


@pytest.mark.parametrize("policy", ADAPTIVE_POLICIES)
def test_always_drafts_in_full_where_it_always_pays(policy: str) -> None:
    # Verification is nearly free and drafts survive: draft every position, every step but
    # the plain probe once every PROBE_INTERVAL steps.
    flat = SpsCurve(points=[(1, 10.0), (512, 9.9)])
    depths = run_steps(controller_on(flat, policy), survival=0.95, steps=4 * PROBE_INTERVAL)
    assert set(depths) == {0, K}
    probes = [step for step, depth in enumerate(depths) if depth == 0]
    assert len(probes) >= 3 and min(b - a for a, b in zip(probes, probes[1:])) == PROBE_INTERVAL


def test_drafts_the_engine_cut_are_not_lost_survival() -> None:
    # The first drafting step is the end of a request (its drafts cut to one by max_tokens):
    # that says nothing about deeper positions, which must still be drafted where they pay.
    flat = SpsCurve(points=[(1, 10.0), (512, 9.9)])
    controller = controller_on(flat)
    first = run_steps(controller, survival=0.95, steps=1, cut_to=1)
    assert run_steps(controller, survival=0.95, steps=PROBE_INTERVAL - 1, depth=first[-1]) == [K] * (PROBE_INTERVAL - 1)


def test_a_deeper_position_left_low_by_an_early_stop_is_probed_again() -> None:
    # Under a heavier load the drafter stopped every request after one position (deeper
    # slots count 0), so one position wins; once drafts survive again, probes one position
    # deeper than the best bring the depth back to K.
    flat = SpsCurve(points=[(1, 10.0), (512, 9.9)])
    controller = controller_on(flat)
    stopped = run_steps(controller, survival=0.95, steps=PROBE_INTERVAL - 1, stopped_after=1)
    assert stopped[-1] == 1
    recovered = run_steps(controller, survival=0.95, steps=8 * PROBE_INTERVAL, depth=stopped[-1])
    assert recovered[-PROBE_INTERVAL:].count(K) >= PROBE_INTERVAL - 1  # the rest: a plain probe
    drafted = [depth for depth in recovered if depth]  # without the plain probes
    assert max(b - a for a, b in zip(drafted, drafted[1:])) == 1, "a deeper probe goes one position deeper"


def test_drafting_flat_in_depth_is_drafted_as_deep_as_pays() -> None:
    """One request on a CPU: the context pass costs 1 ms, the drafter's forward pass 14 ms
    more once it runs at all, whatever the depth. The controller must settle on the depth
    that truly pays; a cost model linear in depth (fitted to the same timings) spreads the
    fixed 14 ms over the positions and drafts shallower."""
    curve = SpsCurve(points=[(b, 1.0 / (0.044 + 0.006 * b)) for b in (1, 2, 3, 4, 5, 8, 64)])
    survival = 0.6
    prefix = np.cumprod(np.full(K, survival))
    depths = np.arange(K + 1)
    tokens = 1.0 + np.r_[0.0, np.cumsum(prefix)]

    def best(drafting: np.ndarray) -> int:
        return int(np.argmax(tokens / (curve.step_time(1 + depths) + drafting)))

    truth = best(np.array([flat_drafting(d) for d in depths]))
    drafted = run_steps(controller_on(curve), survival=survival, steps=20 * PROBE_INTERVAL, requests=1,
                        drafting_seconds=flat_drafting)
    settled = drafted[-8 * PROBE_INTERVAL:]
    assert settled.count(truth) >= len(settled) - 8, settled
    # The case tells the two models apart: a line through the same timings picks another depth.
    slope, intercept = np.polyfit(drafted, [flat_drafting(d) for d in drafted], 1)
    assert best(intercept + slope * depths) < truth


def test_fixed_and_unadaptive_policies_draft_what_they_verify() -> None:
    fixed = VerificationController(PluginOptions(policy="fixed", k=1), None, num_speculative_tokens=K)
    assert fixed.plan_drafting(8).depth == 1
    flat = SpsCurve(points=[(1, 10.0), (512, 9.9)])
    off = VerificationController(
        PluginOptions(policy="dspark", sps_table=flat.points, adaptive_drafting=False), flat, num_speculative_tokens=K
    )
    plan = off.plan_drafting(8)
    assert (plan.depth, plan.min_survival) == (K, 0.0)


# ---------------------------------------------------------------- early stop


def heads_and_inputs(seed: int = 0, n: int = 6, vocab: int = 50):
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           intermediate_size=32, vocab_size=vocab, num_hidden_layers=1, block_size=K,
                           target_layer_ids=[0], mask_token_id=0, markov_rank=4)
    drafter = DSparkDrafter(config)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.normal_(0, 2.0)
    hidden = torch.randn(n, K, 16)
    base = torch.randn(n, K, vocab)
    anchors = torch.randint(0, vocab, (n,))
    return drafter, hidden, base, anchors


def test_positions_past_the_early_stop_are_never_computed() -> None:
    drafter, hidden, base, anchors = heads_and_inputs()
    heads = (drafter.markov_head, drafter.confidence_head, None)
    full = sequential_draft(*heads, base, hidden, anchors)
    asked: list[tuple[int, int]] = []

    def logits(rows: torch.Tensor, j: int) -> torch.Tensor:
        asked.extend((int(r), j) for r in rows)
        return base[rows, j]

    floor = 0.2
    cut = sequential_draft(*heads, logits, hidden, anchors, min_survival=floor)
    survival = torch.cumprod(full.confidences, dim=1)
    expected = {(r, j) for r in range(len(anchors)) for j in range(K) if survival[r, j] >= floor}
    assert set(asked) == expected and cut.lm_head_rows == len(expected)
    assert 0 < len(expected) < len(anchors) * K, "the case must cut some rows and keep others"
    for r in range(len(anchors)):
        depth = int(cut.depths[r])
        assert torch.equal(cut.tokens[r, :depth], full.tokens[r, :depth])
        assert torch.allclose(cut.confidences[r, :depth], full.confidences[r, :depth])
        assert (cut.confidences[r, depth:] == 0).all(), "undrafted positions are never verified"


def test_the_early_stop_never_reads_the_token_it_decides_about() -> None:
    """Whether position j is drafted may not change when the logits at j and later (which
    pick token j and after) change: it reads tokens 0..j-1 only."""
    drafter, hidden, base, anchors = heads_and_inputs(seed=3)
    heads = (drafter.markov_head, drafter.confidence_head, None)
    reference = sequential_draft(*heads, base, hidden, anchors, min_survival=0.2)
    for j in range(K):
        changed = base.clone()
        changed[:, j:] = torch.randn_like(changed[:, j:]) * 5
        other = sequential_draft(*heads, changed, hidden, anchors, min_survival=0.2)
        assert torch.equal(torch.clamp(reference.depths, max=j + 1), torch.clamp(other.depths, max=j + 1))


# ---------------------------------------------------------- reduced vocabulary


@pytest.fixture(scope="module")
def baseline(tiny_target: Path) -> list[list[int]]:
    return generate_ids(make_llm(tiny_target), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def drafters(tiny_target: Path, baseline, tmp_path_factory) -> tuple[Path, Path, np.ndarray]:
    full = make_drafter(tiny_target, tmp_path_factory.mktemp("full"))
    fit_markov_to_transitions(full, tiny_target, [p + o for p, o in zip(PROMPTS, baseline)])
    counts = np.bincount(np.concatenate([np.array(p + o) for p, o in zip(PROMPTS, baseline)]), minlength=512)
    ids = choose_draft_vocab(counts, 96, always=[0, 1])
    reduced = tmp_path_factory.mktemp("reduced")
    reduce_drafter(full, tiny_target, ids, reduced)
    return full, reduced, ids


def test_reduced_checkpoint_is_laid_out_as_vllm_loads_it(drafters, tiny_target) -> None:
    full, reduced, ids = drafters
    config = json.loads((reduced / "config.json").read_text())
    assert config["draft_vocab_size"] == len(ids) and config["vocab_size"] == 512
    weights = load_file(str(reduced / "model.safetensors"))
    full_weights = load_file(str(full / "model.safetensors"))
    # The names Qwen3DSparkForCausalLM.load_weights maps: lm_head.weight, d2t, markov_head.*
    assert weights["lm_head.weight"].shape == (len(ids), config["hidden_size"])
    assert weights["markov_head.markov_w2.weight"].shape == (len(ids), config["markov_rank"])
    assert weights["markov_head.markov_w1.weight"].shape == (512, config["markov_rank"])
    assert torch.equal(torch.arange(len(ids)) + weights["d2t"], torch.from_numpy(ids)), "d2t round trip"
    assert torch.equal(weights["markov_head.markov_w2.weight"], full_weights["markov_head.markov_w2.weight"][ids])
    model = DSparkDrafter.from_pretrained(reduced, tiny_target)
    assert torch.equal(model.draft_to_target(), torch.from_numpy(ids))


def test_reduced_draft_probabilities_are_exact_over_the_target_vocabulary(drafters, tiny_target) -> None:
    _, reduced, ids = drafters
    model = DSparkDrafter.from_pretrained(reduced, tiny_target)
    hidden = torch.randn(5, K, model.config.hidden_size)
    out = model.draft(hidden, torch.tensor([5, 6, 7, 8, 9]), temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]))
    assert out.probs is not None and out.probs.shape == (5, K, 512)
    assert torch.allclose(out.probs.sum(-1), torch.ones(5, K), atol=1e-5)
    outside = torch.ones(512, dtype=torch.bool)
    outside[torch.from_numpy(ids)] = False
    assert (out.probs[..., outside] == 0).all()
    assert torch.isin(out.tokens, torch.from_numpy(ids)).all()
    assert (out.probs.gather(-1, out.tokens.unsqueeze(-1)) > 0).all()


def test_reduced_vocabulary_errors(drafters, tiny_target, tmp_path) -> None:
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                      vocab_size=50, draft_vocab_size=60, num_hidden_layers=1, block_size=4, target_layer_ids=[0],
                      mask_token_id=0)
    with pytest.raises(ConfigError, match="outside the target vocabulary"):
        target_ids_of(torch.tensor([0, 600]), 512)
    with pytest.raises(ConfigError, match="same target id"):
        target_ids_of(torch.tensor([1, 0]), 512)
    with pytest.raises(ConfigError, match="special tokens"):
        choose_draft_vocab(np.ones(512, int), 2, always=[0, 1, 2])
    ids = choose_draft_vocab(np.r_[np.zeros(10, int), np.ones(502, int)], 20, always=[3])
    assert 3 in ids.tolist(), "tokens the drafter must be able to emit are always kept"
    assert coverage(np.r_[np.ones(10), np.zeros(502)], np.arange(5)) == 0.5


def test_reduced_drafter_serves_exactly_through_vllm(drafters, tiny_target, baseline) -> None:
    _, reduced, _ = drafters
    spec = {"method": "vllm_dspark", "model": str(reduced), "num_speculative_tokens": K}
    llm = make_llm(tiny_target, spec, {"vllm_dspark": {"policy": "fixed"}})
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    counters = spec_counters(llm)
    assert counters["num_accepted_tokens"] > 0
    assert counters["num_accepted_tokens"] == engine_scheduler(llm).controller.stats.accepted


def test_reduced_drafter_serves_exactly_through_the_fused_head_path(drafters, tiny_target, baseline,
                                                                    monkeypatch) -> None:
    """Where the fused head runs (CUDA; here its entry point is forced and runs its
    reference), a reduced-vocabulary drafter takes it too, with its draft-to-target map."""
    from tests.test_kernel_wiring import force_kernel_path_on_cpu

    calls = force_kernel_path_on_cpu(monkeypatch)
    _, reduced, _ = drafters
    spec = {"method": "vllm_dspark", "model": str(reduced), "num_speculative_tokens": K}
    llm = make_llm(tiny_target, spec, {"vllm_dspark": {"policy": "fixed"}})
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    assert calls, "the proposer should call the fused head for a reduced vocabulary"
    assert spec_counters(llm)["num_accepted_tokens"] > 0


def test_skipping_and_early_stop_keep_greedy_outputs_exact(drafters, tiny_target, baseline) -> None:
    """A curve where extra verification costs enough that some steps skip drafting and
    the drafter stops low-survival requests early; outputs stay the target's and the
    plugin's counters agree with vLLM's."""
    full, _, _ = drafters
    spec = {"method": "vllm_dspark", "model": str(full), "num_speculative_tokens": K}
    table = [[1, 100.0], [4, 80.0], [8, 40.0], [16, 10.0]]
    llm = make_llm(tiny_target, spec, {"vllm_dspark": {"policy": "dspark", "sps_table": table, "measure_step_overhead": False}})
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
    stats = engine_scheduler(llm).controller.stats
    counters = spec_counters(llm)
    assert stats.draft_depth_counts[0] > 0, "some steps drafted nothing"
    assert sum(stats.draft_depth_counts[1:]) > 0, "and some drafted"
    assert counters["num_draft_tokens"] == stats.verified and counters["num_accepted_tokens"] == stats.accepted


def test_lean_plain_steps_change_no_draft(drafters, tiny_target, baseline) -> None:
    """Steps that draft nothing only queue their context K/V (written before the next
    draft) and, without drafts to verify, skip vLLM's rejection sampler. Two of every
    three proposals forced to draft nothing, greedy: every draft and its confidences
    (which read the drafter's hidden states, hence the context it attends to) equal those
    of the engine that writes the context every step and runs the rejection sampler on
    every step, and outputs stay exact."""
    full, _, _ = drafters
    spec = {"method": "vllm_dspark", "model": str(full), "num_speculative_tokens": K}

    def run(lean: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
        options = {"policy": "fixed", "defer_context": lean, "plain_sampling_without_drafts": lean}
        llm = make_llm(tiny_target, spec, {"vllm_dspark": options})
        runner = engine_runner(llm)
        proposer = runner.drafter
        propose, execute, rejection = proposer.propose, runner.execute_model, runner.rejection_sampler.forward
        drafts, confidences = [], []
        counts = {"most queued": 0, "steps": 0, "steps with drafts": 0, "rejection sampler": 0}

        def every_third(num_speculative_tokens, *args, **kwargs):
            drafted = propose(num_speculative_tokens if len(drafts) % 3 == 2 else 0, *args, **kwargs)
            drafts.append(drafted.clone())
            if drafted.numel():
                confidences.append(proposer._confidences.clone())
            if lean:
                counts["most queued"] = max(counts["most queued"], proposer._deferred.num_tokens)
            return drafted

        def counting_execute(scheduler_output, *args, **kwargs):
            counts["steps"] += 1
            counts["steps with drafts"] += bool(scheduler_output.scheduled_spec_decode_tokens)
            return execute(scheduler_output, *args, **kwargs)

        def counting_rejection(*args, **kwargs):
            counts["rejection sampler"] += 1
            return rejection(*args, **kwargs)

        proposer.propose, runner.execute_model, runner.rejection_sampler.forward = (
            every_third, counting_execute, counting_rejection)
        assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
        return drafts, confidences, counts

    lean_drafts, lean_confidences, lean = run(True)
    drafts, confidences, before = run(False)
    assert lean["most queued"] >= 2 * len(PROMPTS), "two steps' context waited for the next draft"
    assert 0 < lean["steps with drafts"] < lean["steps"]
    assert lean["rejection sampler"] == lean["steps with drafts"]
    assert before["rejection sampler"] == before["steps"]
    assert sum(d.numel() for d in lean_drafts) > 0 and len(lean_drafts) == len(drafts)
    assert all(torch.equal(a, b) for a, b in zip(lean_drafts, drafts))
    assert len(lean_confidences) == len(confidences) > 0
    for a, b in zip(lean_confidences, confidences):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_steps_without_drafting_queue_their_context_straight_from_the_runner(drafters, tiny_target, baseline) -> None:
    """The scheduler plans no drafting on two of every three steps, so steps that draft
    nothing come often, both after a drafting step (they verify its drafts, some rejected)
    and after another such step (they verify nothing): with the context deferred their rows
    are taken from the runner's state (patch 14) instead of vLLM's proposal preparation.
    Every draft and confidence equals those of the engine that writes the context every
    step through vLLM's path, and outputs stay exact."""
    from vllm_dspark.integration import compat
    from vllm_dspark.scheduling.controller import DraftPlan

    full, _, _ = drafters
    spec = {"method": "vllm_dspark", "model": str(full), "num_speculative_tokens": K}

    def run(lean: bool, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
        llm = make_llm(tiny_target, spec, {"vllm_dspark": {"policy": "fixed", "defer_context": lean}})
        controller, proposer = engine_scheduler(llm).controller, engine_runner(llm).drafter
        plan, propose = controller.plan_drafting, proposer.propose
        drafts, confidences, plans, fast = [], [], [0], []

        def one_in_three(*args, **kwargs):
            plans[0] += 1
            return plan(*args, **kwargs) if plans[0] % 3 == 0 else DraftPlan(0, 0.0)

        def recording(num_speculative_tokens, *args, **kwargs):
            drafted = propose(num_speculative_tokens, *args, **kwargs)
            if drafted.numel():
                drafts.append(drafted.clone())
                confidences.append(proposer._confidences.clone())
            return drafted

        straight = compat.plain_step_context

        def counted(runner, drafter, step):
            fast.append(step["spec_decode_metadata"] is not None)  # whether the step verified drafts
            return straight(runner, drafter, step)

        controller.plan_drafting, proposer.propose = one_in_three, recording
        monkeypatch.setattr(compat, "plain_step_context", counted)
        assert generate_ids(llm, PROMPTS, MAX_TOKENS) == baseline
        monkeypatch.undo()
        return drafts, confidences, fast

    with pytest.MonkeyPatch.context() as monkeypatch:
        lean_drafts, lean_confidences, lean_fast = run(True, monkeypatch)
        drafts, confidences, fast = run(False, monkeypatch)
    assert any(lean_fast) and not all(lean_fast), "steps that verified drafts and steps that did not"
    assert not fast, "the straight path runs only where the context is deferred"
    assert len(lean_drafts) == len(drafts) > 0
    assert all(torch.equal(a, b) for a, b in zip(lean_drafts, drafts))
    for a, b in zip(lean_confidences, confidences):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_deferred_writes_land_as_writes_in_order() -> None:
    generator = torch.Generator().manual_seed(0)
    queue, in_order = DeferredContext(max_tokens=35), torch.zeros(16)
    for _ in range(5):  # slots written again and again, padding (-1) among them
        slots = torch.randint(-1, 16, (7,), generator=generator)
        values = torch.randn(7, 1, generator=generator)
        queue.add(ContextRows(values, torch.arange(7), slots))
        for slot, value in zip(slots.tolist(), values[:, 0].tolist()):
            if slot >= 0:
                in_order[slot] = value
    assert queue.full and queue.num_tokens == 35
    rows = queue.take()
    assert rows is not None and queue.take() is None and queue.num_tokens == 0
    batched, kept = torch.zeros(16), rows.slots >= 0
    batched[rows.slots[kept]] = rows.hidden_states[kept, 0]  # one scatter, no duplicate slots left
    assert torch.equal(batched, in_order)
    assert len(set(rows.slots[kept].tolist())) == int(kept.sum())
    assert torch.equal(last_writes_only(torch.tensor([3])), torch.tensor([3]))


# ------------------------------------------------------------- out of the box


def test_only_speculative_config_profiles_at_startup_then_reuses_it(tiny_target, tmp_path, monkeypatch) -> None:
    from vllm_dspark.scheduling.profiles import cached_profile_path, profile_key

    monkeypatch.setenv("VLLM_DSPARK_CACHE", str(tmp_path / "cache"))
    drafter = make_drafter(tiny_target, tmp_path / "drafter")
    spec = {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": K}
    options = PluginOptions.from_additional_config({})
    assert (options.policy, options.sps_profile, options.profile_at_startup) == ("dspark", "auto", True)
    assert "default" in options.choice()

    llm = make_llm(tiny_target, spec, max_num_seqs=4)
    cached = cached_profile_path(profile_key(str(tiny_target), "float32"))
    assert cached.is_file(), "the start-up profile is written to the cache"
    assert engine_scheduler(llm).controller.policy.name == "dspark"
    assert [b for b, _ in engine_scheduler(llm).controller.curve.points] == [1, 4, 16, 20]  # 4 x (1 + K)
    del llm
    stamp = cached.stat().st_mtime_ns
    llm = make_llm(tiny_target, spec, max_num_seqs=4)
    assert cached.stat().st_mtime_ns == stamp, "the next start reuses it"
    del llm
    cached.write_text("{not json")
    with pytest.raises(Exception, match="cached SPS profile .* is unusable"):
        make_llm(tiny_target, spec, max_num_seqs=4)
