"""Hybrid proposals (scheduling/hybrid.py): the n-gram lookup, its learned confidences,
the choice between the two proposals and why that choice keeps verification exact."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_scheduling_exactness import CHI2_1DOF_P001, TARGET, chi_square
from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import hybrid
from vllm_dspark.scheduling.controller import PROBE_INTERVAL, StepInputs, VerificationController
from vllm_dspark.scheduling.sps import SpsCurve


def reference_lookup(context: list[int], k: int, max_model_len: int, max_match: int = hybrid.MAX_MATCH,
                     most_recent: bool = True) -> tuple[int, list[int]]:
    """Brute force: the longest (<= max_match) suffix match, the most recent (or the
    earliest) on ties."""
    best, best_end = 0, -1
    ends = range(len(context) - 2, -1, -1) if most_recent else range(len(context) - 1)
    for end in ends:
        n = 0
        while n < max_match and end - n >= 0 and context[end - n] == context[len(context) - 1 - n]:
            n += 1
        if n > best:
            best, best_end = n, end
    if best < hybrid.MIN_MATCH:
        return 0, []
    count = min(k, len(context) - 1 - best_end, max_model_len - 1 - len(context))
    return (best, context[best_end + 1 : best_end + 1 + count]) if count > 0 else (0, [])


def batch(contexts: list[list[int]], width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    token_ids = np.zeros((len(contexts) + 1, width), dtype=np.int32)  # one spare row, as in vLLM's batch
    for row, context in enumerate(contexts):
        token_ids[row, : len(context)] = context
    return token_ids, np.array([len(c) for c in contexts] + [0])


def test_lookup_takes_the_longest_most_recent_match() -> None:
    contexts = [
        [5, 6, 7, 8, 9, 1, 2, 5, 6, 7],  # suffix 5 6 7 seen at the start: continue 8 9 1
        [1, 2, 3, 4],  # nothing repeats
        [3, 9, 3, 4, 1, 3, 4, 2, 3, 4],  # "3 4" twice before: the most recent one continues with 2
        [4, 4],  # a one-token match is too weak
    ]
    token_ids, num_tokens = batch(contexts)
    out = hybrid.lookup_continuations(token_ids, num_tokens, [0, 1, 2, 3], k=3, max_model_len=64)
    assert out.matches.tolist() == [3, 0, 2, 0]
    assert out.lengths.tolist() == [3, 0, 3, 0]
    assert out.tokens[0].tolist() == [8, 9, 1]
    assert out.tokens[2].tolist() == [2, 3, 4]
    # Rows are looked up where the batch has them, in the order asked.
    again = hybrid.lookup_continuations(token_ids, num_tokens, [2, 0], k=3, max_model_len=64)
    assert again.tokens.tolist() == [out.tokens[2].tolist(), out.tokens[0].tolist()]


def test_lookup_stops_at_the_context_and_the_model_length() -> None:
    token_ids, num_tokens = batch([[1, 2, 1, 2]])
    out = hybrid.lookup_continuations(token_ids, num_tokens, [0], k=5, max_model_len=64)
    assert out.tokens[0, : out.lengths[0]].tolist() == [1, 2]  # only what followed the match
    short = hybrid.lookup_continuations(token_ids, num_tokens, [0], k=5, max_model_len=6)
    assert short.lengths.tolist() == [1]  # 4 tokens + 1 draft + the bonus token = 6
    full = hybrid.lookup_continuations(token_ids, num_tokens, [0], k=5, max_model_len=5)
    assert full.lengths.tolist() == full.matches.tolist() == [0]


@pytest.mark.parametrize(("max_match", "most_recent"), [(hybrid.MAX_MATCH, True), (4, False), (3, True), (12, False)])
def test_lookup_matches_the_brute_force_reference(max_match: int, most_recent: bool) -> None:
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 4, size=rng.integers(1, 60)).tolist() for _ in range(200)]
    contexts += [[1, 2] * 20, [3] * 30, []]  # matches longer than MAX_MATCH; an empty row
    token_ids, num_tokens = batch(contexts, width=64)
    out = hybrid.lookup_continuations(token_ids, num_tokens, np.arange(len(contexts)), k=4, max_model_len=58,
                                      max_match=max_match, most_recent=most_recent)
    for row, context in enumerate(contexts):
        match, continuation = reference_lookup(context, 4, 58, max_match, most_recent)
        assert (out.matches[row], out.tokens[row, : out.lengths[row]].tolist()) == (match, continuation), context


def test_confidences_are_learned_per_mode_match_and_position() -> None:
    table = hybrid.NgramConfidence(width=4, forgetting=1.0)
    prior = table.conditional(np.array([2]), np.array([4]), np.array([True]))
    assert np.allclose(prior, 0.5)
    rng = np.random.default_rng(0)
    # Greedy requests with long matches: 90% of each draft accepted; sampled: 20%.
    for greedy, rate in ((True, 0.9), (False, 0.2)):
        for _ in range(2000):
            draws = rng.random(4) < rate
            accepted = 4 if draws.all() else int(np.argmin(draws))
            table.observe(np.array([6]), np.array([greedy]), np.array([4]), np.array([accepted]))
    greedy_row = table.conditional(np.array([6]), np.array([4]), np.array([True]))[0]
    sampled_row = table.conditional(np.array([9]), np.array([4]), np.array([False]))[0]  # 9 shares 6's bucket
    assert np.allclose(greedy_row, 0.9, atol=0.06)
    assert np.allclose(sampled_row[:2], 0.2, atol=0.06)
    # A match length never observed keeps the prior; positions past a proposal are 0.
    assert np.allclose(table.conditional(np.array([2]), np.array([2]), np.array([True]))[0], [0.5, 0.5, 0, 0])


def test_choice_compares_expected_accepted_tokens() -> None:
    strong = np.array([[0.9, 0.9, 0.9, 0.9]])
    weak = np.array([[0.2, 0.0, 0.0, 0.0]])
    survival = np.array([0.8, 0.6, 0.4, 0.2])
    assert hybrid.prefer_ngram(strong, np.array([0.5]), 4, survival).tolist() == [True]
    assert hybrid.prefer_ngram(weak, np.array([0.8]), 4, survival).tolist() == [False]
    # Nothing drafted this step: any continuation beats none.
    assert hybrid.prefer_ngram(weak, np.array([0.0]), 0, None).tolist() == [True]
    assert hybrid.prefer_ngram(np.zeros((1, 4)), np.array([0.0]), 0, None).tolist() == [False]


def first_token(rng: np.random.Generator, use_ngram: bool, x1: int) -> int:
    """One round of rejection sampling with the chosen proposal: the drafter's x1 ~ (0.5,
    0.5), or the n-gram's token A (0) as a point mass."""
    draft = np.array([1.0, 0.0]) if use_ngram else np.array([0.5, 0.5])
    token = 0 if use_ngram else x1
    if rng.random() < min(1.0, TARGET[token] / draft[token]):
        return token
    residual = np.maximum(TARGET - draft, 0.0)
    return int(rng.random() < residual[1] / residual.sum())


def first_token_counts(choose, seed: int, trials: int = 20_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(2, dtype=np.int64)
    for _ in range(trials):
        c1 = rng.random()  # the drafter's first confidence: known before x1 is drawn
        x1 = int(rng.random() < 0.5)
        counts[first_token(rng, bool(choose(c1, x1)), x1)] += 1
    return counts


NGRAM_ROW = np.array([[0.6, 0.5]])


def test_the_choice_keeps_the_target_distribution() -> None:
    """The hybrid choice reads c_1, not x_1: the first output token stays the target's."""
    choose = lambda c1, x1: hybrid.prefer_ngram(NGRAM_ROW, np.array([c1]), 2, np.array([0.7, 0.5]))[0]
    counts = first_token_counts(choose, seed=2)
    mixed = first_token_counts(lambda c1, x1: c1 < 0.5, seed=3)
    assert chi_square(counts, TARGET) < CHI2_1DOF_P001, counts
    assert chi_square(mixed, TARGET) < CHI2_1DOF_P001, mixed


def test_a_choice_that_reads_the_drafted_token_is_caught() -> None:
    """Negative control: keeping the drafter's block only when it drew A (what reading
    c_2, which depends on x_1, amounts to) skews the output towards A."""
    counts = first_token_counts(lambda c1, x1: x1 == 1, seed=4)
    assert chi_square(counts, TARGET) > 100.0, counts


CURVE = SpsCurve(points=[(1, 10.0), (64, 9.8), (300, 8.0)])


def controller(**options) -> VerificationController:
    plugin = PluginOptions(policy="dspark", sps_table=CURVE.points, measure_step_overhead=False, **options)
    return VerificationController(plugin, CURVE, num_speculative_tokens=4)


def test_controller_prices_ngram_rows_by_their_own_acceptance_and_learns_them_apart() -> None:
    ctrl = controller()
    drafter_row = [0.9, 0.9, 0.9, 0.9]
    step = StepInputs(req_ids=("a", "b"), confidences=np.array([drafter_row, [0.0] * 4]), proposed=np.array([4, 3]),
                      greedy=np.array([True, True]), ngram_matches=np.array([0, 5]))
    decision = ctrl.decide(step)
    assert np.allclose(decision.confidences[1], [0.5, 0.5, 0.5, 0.0])  # the n-gram prior, 3 drafts
    ctrl.step_scheduled(0.0, 9)
    recalibration_before = ctrl.recalibrators["greedy"].judged.copy()
    ctrl.observe(np.array([1, 4]))  # a: all 4 drafts rejected; b: all 3 accepted
    assert ctrl.stats.ngram_proposed == 3 and ctrl.stats.ngram_verified == decision.verified[1]
    assert ctrl.stats.ngram_accepted == 3
    assert ctrl.ngram.judged[0, hybrid.match_buckets(5)].sum() == 3
    # The drafter's recalibration saw only the drafter's row (one judged, rejected draft).
    assert (ctrl.recalibrators["greedy"].judged - recalibration_before).sum() == 1


def test_hybrid_off_never_prefers_ngram() -> None:
    ctrl = controller(hybrid_ngram=False)
    assert ctrl.ngram is None
    proposals = hybrid.NgramProposals(np.ones((2, 4), dtype=np.int64), np.array([4, 4]), np.array([8, 8]))
    assert not ctrl.prefer_ngram(np.array([0.0, 0.1]), np.array([True, False]), proposals, 0).any()


@pytest.mark.parametrize("first", [np.nan, -1.0, 2.0])
def test_invalid_first_confidence_counts_as_no_draft(first: float) -> None:
    ctrl = controller()
    proposals = hybrid.NgramProposals(np.ones((1, 4), dtype=np.int64), np.array([1]), np.array([2]))
    # A weak one-token continuation (expected 0.5) beats a drafter whose c_1 is unusable.
    assert ctrl.prefer_ngram(np.array([first]), np.array([True]), proposals, 4).tolist() == [True]


def learned_table(ctrl: VerificationController, match: int, accepted_of_4: int, steps: int = 50) -> None:
    """Teach the controller's n-gram confidence: greedy continuations with this match
    length, `accepted_of_4` of 4 verified drafts accepted each time."""
    for _ in range(steps):
        ctrl.ngram.observe(np.array([match]), np.array([True]), np.array([4]), np.array([accepted_of_4]))


def skip_rule(drafter_expected, drafting_seconds: float, pass_seconds=None) -> hybrid.DrafterSkip:
    """A skip rule at depth 4 over a table that expects 3.1 drafts of greedy long matches
    (0.9 each) and 0.43 of greedy short ones (0.3 each); a free verification by default."""
    table = np.zeros((2, hybrid.MATCH_BUCKETS, 4))
    table[0, hybrid.match_buckets(6)] = 0.9
    table[0, hybrid.match_buckets(2)] = 0.3
    pass_seconds = np.full(9, 0.04) if pass_seconds is None else pass_seconds
    expected = np.asarray(drafter_expected, dtype=np.float64)
    expected = np.tile(expected, (hybrid.CONTINUATION_KEYS, 1)) if expected.ndim == 1 else expected
    return hybrid.DrafterSkip(table, 4, expected, pass_seconds, drafting_seconds)


GREEDY = np.array([True, True])
LONG_BOTH = hybrid.NgramProposals(np.ones((2, 4), dtype=np.int64), np.array([4, 4]), np.array([6, 7]))
ONE_SHORT = hybrid.NgramProposals(np.ones((2, 4), dtype=np.int64), np.array([4, 4]), np.array([6, 2]))
ONE_MISSING = hybrid.NgramProposals(np.ones((2, 4), dtype=np.int64), np.array([4, 0]), np.array([6, 0]))


def test_drafter_skip_weighs_the_drafters_tokens_against_its_seconds() -> None:
    # Continuations that beat the drafter everywhere: drafting would only cost.
    assert skip_rule([1.0], drafting_seconds=0.001).applies(LONG_BOTH, GREEDY)
    # The short match's request gains 0.57 expected drafts from the drafter (1.0 against
    # 0.43): worth 1 ms of drafting on a 40 ms pass, not 7 ms.
    assert not skip_rule([1.0], drafting_seconds=0.001).applies(ONE_SHORT, GREEDY)
    assert skip_rule([1.0], drafting_seconds=0.007).applies(ONE_SHORT, GREEDY)
    # Without a continuation the drafter's whole block is the gain.
    assert not skip_rule([1.0], drafting_seconds=0.004).applies(ONE_MISSING, GREEDY)
    # ... unless verifying its drafts makes the pass dearer than they bring (5 ms a draft).
    assert skip_rule([1.0], 0.001, pass_seconds=0.04 + 0.005 * np.arange(9)).applies(ONE_MISSING, GREEDY)
    assert not skip_rule([1.0], drafting_seconds=0.001).applies(LONG_BOTH, np.array([True, False])), \
        "sampled rows have their own (unlearned, zero) table"
    assert not skip_rule([], drafting_seconds=0.0).applies(LONG_BOTH, GREEDY), "no c_1 seen yet"


def test_drafter_skip_counts_the_confident_steps_of_the_drafter() -> None:
    """The choice takes the better proposal per request, so the drafter's worth is the mean
    of a maximum: c_1 values spread around a mean are worth more than the mean alone."""
    assert skip_rule([0.9] * 4, drafting_seconds=0.004).applies(ONE_SHORT, GREEDY)
    assert not skip_rule([0.2, 0.2, 0.2, 3.0], drafting_seconds=0.004).applies(ONE_SHORT, GREEDY)


def test_drafter_skip_values_the_drafter_by_the_requests_situation() -> None:
    """A drafter confident where the context repeats itself (long matches) and weak
    elsewhere: its worth beside a long match is read from its c_1 there."""
    expected = np.full((hybrid.CONTINUATION_KEYS, 1), 0.2)
    assert skip_rule(expected, drafting_seconds=0.001).applies(ONE_SHORT, GREEDY)
    expected[1 + hybrid.match_buckets(6)] = 3.5  # beats the long match's 3.1
    assert not skip_rule(expected, drafting_seconds=0.001).applies(ONE_SHORT, GREEDY)
    expected[1 + hybrid.match_buckets(6)] = 0.2
    assert not skip_rule(expected, drafting_seconds=0.001).applies(ONE_MISSING, GREEDY), \
        "the request without a continuation gains the drafter's 0.2"


def with_drafter_and_ngram_learned(ctrl: VerificationController) -> VerificationController:
    ctrl.mean_survival = np.array([0.4, 0.2, 0.1, 0.05])
    ctrl._survival_seen_at[:] = 0.0
    learned_table(ctrl, match=6, accepted_of_4=4)
    return ctrl


def test_the_plan_carries_the_skip_only_where_it_can_apply() -> None:
    proposals = hybrid.NgramProposals(np.ones((1, 4), dtype=np.int64), np.array([4]), np.array([6]))
    ctrl = with_drafter_and_ngram_learned(controller(ngram_skips_drafter=True))
    assert ctrl.plan_drafting(1).drafter_skip is None, "no c_1 of the drafter seen yet"
    ctrl.prefer_ngram(np.array([0.0]), np.array([True]), proposals, 0)
    assert ctrl.plan_drafting(1).drafter_skip is None, "a step without drafts shows no c_1"
    ctrl.prefer_ngram(np.array([0.3]), np.array([True]), proposals, 4)
    plan = ctrl.plan_drafting(1)
    assert plan.depth > 0 and plan.drafter_skip is not None and plan.drafter_skip.depth == plan.depth
    first = ctrl._recalibrated(np.array([[0.3]]), np.array([True]))[0, 0]
    # Seen beside a match of 6 only: every key takes it until its own values come.
    assert np.allclose(plan.drafter_skip.drafter_expected,
                       hybrid.drafter_expected(np.array([first]), plan.depth, ctrl.mean_survival))
    none = hybrid.NgramProposals(np.zeros((1, 4), dtype=np.int64), np.array([0]), np.array([0]))
    ctrl.prefer_ngram(np.array([0.9]), np.array([True]), none, 4)
    expected = ctrl.plan_drafting(1).drafter_skip.drafter_expected
    assert expected[0].min() > expected[1 + hybrid.match_buckets(6)].max(), "each key its own values"
    assert np.allclose(expected[1 + hybrid.match_buckets(6)],
                       hybrid.drafter_expected(np.array([first]), plan.depth, ctrl.mean_survival))
    assert plan.drafter_skip.applies(proposals, np.array([True])), "a 4-of-4 continuation against a weak drafter"
    assert with_drafter_and_ngram_learned(controller(ngram_skips_drafter=False)).plan_drafting(1).drafter_skip is None
    assert PluginOptions().ngram_skips_drafter, "on by default"


def test_a_probe_is_never_left_out() -> None:
    ctrl = with_drafter_and_ngram_learned(controller(ngram_skips_drafter=True))
    ctrl.mean_survival = np.array([0.5, 0.0, 0.0, 0.0])  # best depth 1; probes at 2 and 0
    ctrl.prefer_ngram(np.array([0.3]), np.array([True]),
                      hybrid.NgramProposals(np.ones((1, 4), dtype=np.int64), np.array([4]), np.array([6])), 4)
    plans = [ctrl.plan_drafting(1) for _ in range(3 * PROBE_INTERVAL)]
    best = max(set(p.depth for p in plans), key=[p.depth for p in plans].count)
    assert best == 1 and any(p.depth == 2 for p in plans), "the deeper probes ran"
    assert all((p.drafter_skip is None) == (p.depth != best) for p in plans if p.depth)


def test_lookup_after_step_appends_the_sampled_tokens() -> None:
    """The worker decides the skip before vLLM's bookkeeping writes the step's tokens into
    the batch: its lookup must see them (the accepted drafts and the bonus token, not the
    rejected placeholders) and equal the lookup on the finished contexts."""
    import torch
    from types import SimpleNamespace

    from vllm_dspark.integration.vllm_patches import lookup_after_step

    before = [[5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2]]
    sampled = [[7, 8, -1, -1], [3, -1, -1, -1]]  # two tokens, one token
    token_ids, num_tokens = batch(before)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=2, token_ids_cpu=token_ids, num_tokens_no_spec=num_tokens, req_ids=["a", "b"]),
        discard_request_mask=SimpleNamespace(np=np.zeros(3, dtype=bool)), num_spec_tokens=4, max_model_len=64)
    req_ids, proposals = lookup_after_step(runner, torch.tensor(sampled))
    after_ids, after_counts = batch([b + [t for t in s if t >= 0] for b, s in zip(before, sampled)])
    expected = hybrid.lookup_continuations(after_ids, after_counts, np.arange(2), 4, 64)
    assert req_ids == ("a", "b")
    assert proposals.matches.tolist() == expected.matches.tolist() == [4, 3]
    assert proposals.tokens.tolist() == expected.tokens.tolist()
    assert token_ids[0, 7] == 0, "the batch itself is left for vLLM's bookkeeping"
    runner.discard_request_mask.np[1] = True  # a prompt chunk: its sampled token is discarded
    assert lookup_after_step(runner, torch.tensor(sampled)) is None


def test_requests_without_a_proposal_count_as_plain_requests_of_the_pass() -> None:
    """A step where only some requests have an n-gram continuation (the drafter not
    drafting): the others decode one token each in the same pass. Counted, they raise the
    bar for the continuation's drafts; left out, the policy would verify as if the pass
    served the drafting request alone."""
    from types import SimpleNamespace

    from vllm_dspark.integration.scheduler import other_tokens

    decoding = [SimpleNamespace(num_tokens=40, num_computed_tokens=39) for _ in range(7)]
    prompt_chunk = SimpleNamespace(num_tokens=300, num_computed_tokens=100)
    waiting = [SimpleNamespace(num_tokens=12, num_computed_tokens=0)]
    assert other_tokens(decoding + [prompt_chunk], waiting) == (7 + 200 + 12, 7)
    row = hybrid.NgramConfidence(4).conditional(np.array([5]), np.array([4]), np.array([True]))  # 0.5 each
    steep = SpsCurve(points=[(1, 10.0), (16, 5.0)])  # a step of 8 tokens costs 1.47 of one
    ctrl = VerificationController(PluginOptions(policy="dspark", sps_table=steep.points, measure_step_overhead=False),
                                  steep, num_speculative_tokens=4)
    alone, beside_plain = (ctrl.decide(StepInputs(
        req_ids=("a",), confidences=row, proposed=np.array([4]), greedy=np.array([True]), ngram_matches=np.array([5]),
        base_tokens=plain, plain_requests=plain)) for plain in (0, 7))
    assert beside_plain.plain_requests == 7
    assert (alone.verified[0], beside_plain.verified[0]) == (3, 1)
