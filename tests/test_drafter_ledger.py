"""Admission with or without the drafter, from its measured balance per load."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_hybrid import controller, with_drafter_and_ngram_learned
from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import hybrid
from vllm_dspark.scheduling.controller import StepInputs
from vllm_dspark.scheduling.drafter_ledger import FORGETTING, MIN_EVIDENCE, DrafterLedger

# Steps with the drafter a fresh account needs to hold MIN_EVIDENCE discounted ones.
TRIAL = int(np.ceil(np.log(1 - MIN_EVIDENCE * (1 - FORGETTING)) / np.log(FORGETTING)))


def losing_steps(ledger: DrafterLedger, num_requests: int, steps: int, with_drafter: int | None = None) -> None:
    """Drafting steps whose drafter costs 10 ms and saves 4 ms of pass time."""
    with_drafter = num_requests if with_drafter is None else with_drafter
    for _ in range(steps):
        ledger.observe_proposal(num_requests, with_drafter, 0.010)
        ledger.observe_outcome(num_requests, with_drafter, accepted=1, added_pass_s=0.0, token_value_s=0.004)


def test_a_load_admits_with_the_drafter_until_its_losses_are_measured() -> None:
    ledger = DrafterLedger()
    losing_steps(ledger, 16, TRIAL - 1)
    assert ledger.admits(16), "too few steps to judge"
    losing_steps(ledger, 16, 1)
    assert not ledger.admits(16) and not ledger.admits(31), "16-31 requests share a load bucket"
    assert ledger.admits(15) and ledger.admits(4), "each load is judged on its own"


def test_a_drafter_that_saves_more_than_it_costs_keeps_being_admitted() -> None:
    ledger = DrafterLedger()
    for _ in range(2 * TRIAL):
        ledger.observe_proposal(4, 4, 0.002)
        ledger.observe_outcome(4, 4, accepted=2, added_pass_s=0.001, token_value_s=0.006)
    balance = ledger.balance(4)
    assert balance.gained_s > balance.spent_s and ledger.admits(4)


def test_verification_time_counts_against_the_drafter() -> None:
    ledger = DrafterLedger()
    for _ in range(TRIAL):  # free drafting, 2 ms saved, 3 ms of pass time added
        ledger.observe_proposal(4, 4, 0.0)
        ledger.observe_outcome(4, 4, accepted=1, added_pass_s=0.003, token_value_s=0.002)
    assert not ledger.admits(4)


def test_evidence_fades_without_the_drafter_then_a_new_trial_admits_with_it() -> None:
    ledger = DrafterLedger()
    losing_steps(ledger, 16, TRIAL + 20)
    assert not ledger.admits(16)
    # Every request now lacks the drafter: steps still propose (the context-free pass).
    needed = int(np.ceil(np.log(MIN_EVIDENCE / ledger.balance(16).steps) / np.log(FORGETTING)))
    for _ in range(needed - 1):
        ledger.observe_proposal(16, 0, 0.0)
    assert not ledger.admits(16)
    ledger.observe_proposal(16, 0, 0.0)
    assert ledger.admits(16) and ledger.balance(16).steps == 0.0, "a fresh account"
    losing_steps(ledger, 16, TRIAL - 1)
    assert ledger.admits(16), "the trial lasts until the new account holds enough steps"
    losing_steps(ledger, 16, 1)
    assert not ledger.admits(16)


def test_costs_are_charged_as_if_every_request_had_the_drafter() -> None:
    """Two of sixteen requests with the drafter: the forward pass over all sixteen and the
    two requests' gains are scaled to a pass where all had it, so that a few requests
    admitted to test a load do not make it look dearer than it is."""
    everyone, few = DrafterLedger(), DrafterLedger()
    everyone.observe_proposal(16, 16, 0.008)
    everyone.observe_outcome(16, 16, accepted=8, added_pass_s=0.004, token_value_s=0.003)
    few.observe_proposal(16, 2, 0.001)
    few.observe_outcome(16, 2, accepted=1, added_pass_s=0.0005, token_value_s=0.003)
    for name in ("gained_s", "spent_s"):
        assert getattr(few.balance(16), name) == pytest.approx(getattr(everyone.balance(16), name))


def test_the_controller_admits_by_its_ledger_and_counts_the_requests_turned_away() -> None:
    ctrl = controller(drafter_admission=True)
    assert ctrl.ledger is not None
    assert ctrl.admit_drafter(16)
    for _ in range(TRIAL):  # the drafter's proposals cost 50 ms a step; no block is ever accepted
        ctrl.observe_drafting(16, 2, 32, 0.05, with_drafter=16)
    assert not ctrl.admit_drafter(16) and ctrl.stats.requests_without_drafter == 1
    assert ctrl.admit_drafter(1), "another load"
    assert "1 requests admitted without the drafter" in ctrl.stats.summary()
    from vllm_dspark.integration.metrics import metric_families

    counted = {f.name: f.samples[0].value for f in metric_families({0: ctrl.stats}) if f.samples}
    assert counted["vllm_dspark_requests_without_drafter"] == 1
    off = controller()
    assert not PluginOptions().drafter_admission, "off by default"
    assert off.ledger is None and off.admit_drafter(16)


def test_the_ledger_values_only_the_drafters_blocks_by_the_step_time_model() -> None:
    """A step verifying a drafter block (row a) and an n-gram continuation (row b): the
    ledger gains a's accepted drafts at a plain pass's seconds per request and is charged
    the pass time a's verified drafts added, from the profile."""
    ctrl = controller(drafter_admission=True)
    step = StepInputs(req_ids=("a", "b"), confidences=np.array([[0.9] * 4, [0.0] * 4]), proposed=np.array([4, 3]),
                      greedy=np.array([True, True]), ngram_matches=np.array([0, 5]))
    decision = ctrl.decide(step)
    ctrl.step_scheduled(0.0, 2 + int(decision.verified.sum()), num_requests=2, with_drafter=2)
    ctrl.observe(np.array([3, 4]))  # a: 2 drafts accepted; b: 3
    a, b = (int(v) for v in decision.verified)
    assert a >= 2
    seconds = ctrl._pass_seconds(np.array([2 + b, 2 + a + b, 2]))
    balance = ctrl.ledger.balance(2)
    assert balance.gained_s == pytest.approx(2 * seconds[2] / 2)
    assert balance.spent_s == pytest.approx(seconds[1] - seconds[0])


def test_a_pass_without_any_request_having_the_drafter_drafts_nothing() -> None:
    ctrl = with_drafter_and_ngram_learned(controller())
    assert ctrl.plan_drafting(4, 4).depth > 0
    assert ctrl.plan_drafting(4, 0).depth == 0


def test_a_drafter_pass_that_only_one_request_can_use_is_not_run() -> None:
    """The depth model counts drafts for the requests that can verify them, while the
    drafter's pass (here 10 ms on a 100 ms step) is paid for everyone's rows."""
    def ctrl():
        learned = with_drafter_and_ngram_learned(controller())
        learned.drafting_cost.weights = np.array([0.0, 0.010, 0.0, 0.0])
        return learned

    assert ctrl().plan_drafting(16, 16).depth > 0
    assert ctrl().plan_drafting(16, 1).depth == 0


def test_requests_without_the_drafter_take_any_continuation_and_teach_the_skip_nothing() -> None:
    ctrl = with_drafter_and_ngram_learned(controller())
    short = hybrid.NgramProposals(np.ones((3, 4), dtype=np.int64), np.array([1, 1, 0]), np.array([2, 2, 0]))
    greedy = np.array([True, True, True])
    chosen = ctrl.prefer_ngram(np.array([0.99, 0.99, 0.99]), greedy, short, 4, np.array([True, False, False]))
    assert chosen.tolist() == [False, True, False], "a confident drafter wins where it has its context"
    seen = [c for recent in ctrl._first_confidences for c in recent]
    assert len(seen) == 1, "only the request with the drafter taught the skip rule its c_1"
