"""The per-user floor (scheduling/user_floor.py): the ledger of time speculation won or lost
per request, the trim that keeps every request of a pass within its allowance, and the
controller keeping requests without proposals from paying for the others' drafts."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_step_time_model import STARTUP_CURVE
from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.user_floor import FORGET_AFTER_STEPS, UserLedger, trim_to_floor

PLAIN_S = 0.04  # a plain step in the trims below
EXTRA_PER_DRAFT_S = 0.002  # what each verified draft adds to the pass


def extra(total: int) -> np.ndarray:
    return EXTRA_PER_DRAFT_S * np.arange(total + 1, dtype=np.float64)


def test_the_ledger_charges_each_request_its_steps_against_plain_ones() -> None:
    ledger = UserLedger(allowance=0.05)
    ledger.add(("fast", "slow", "gone"), np.array([3.0, 1.0, np.nan]), plain_step_s=0.04, measured_s=0.05)
    credit = np.array([3 * 0.04 - 0.05, 0.04 - 0.05])
    assert ledger.slack(("fast", "slow", "gone", "new")) == pytest.approx(
        np.r_[credit + 0.05 * 0.05, np.inf, np.inf]), "NaN (no output) is not charged; not charged yet: no bound"


def test_the_ledger_forgets_requests_no_longer_seen() -> None:
    ledger = UserLedger(allowance=0.0)
    ledger.add(("old",), np.array([1.0]), 0.04, 0.05)
    for _ in range(2 * FORGET_AFTER_STEPS):
        ledger.add(("a", "b"), np.array([1.0, 1.0]), 0.04, 0.04)
    assert ledger.slack(("old",))[0] == np.inf and ledger.slack(("a",))[0] == pytest.approx(0.0)


def test_a_step_every_request_can_pay_for_is_kept() -> None:
    verified = np.array([3, 1])
    survival = np.array([[0.9, 0.8, 0.7], [0.5, 0.0, 0.0]])
    kept = trim_to_floor(verified, survival, np.array([0.1, 0.1]), 0.1, extra(4), PLAIN_S)
    assert kept.tolist() == [3, 1]


def test_a_plain_request_without_slack_keeps_the_step_plain() -> None:
    survival = np.array([[0.99, 0.98, 0.97]])
    for plain_slack in (0.0, -0.01):
        assert trim_to_floor(np.array([3]), survival, np.array([1.0]), plain_slack, extra(3), PLAIN_S).tolist() == [0]


def test_the_most_likely_drafts_stay_while_the_extra_time_fits() -> None:
    """A plain request with room for two drafts' extra time: the two most likely drafts stay."""
    survival = np.array([[0.9, 0.4, 0.2], [0.6, 0.5, 0.1]])
    kept = trim_to_floor(np.array([3, 3]), survival, np.array([1.0, 1.0]), 2.5 * EXTRA_PER_DRAFT_S, extra(6), PLAIN_S)
    assert kept.tolist() == [1, 1]


def test_a_request_behind_plain_decoding_keeps_its_pass_plain_whatever_its_own_drafts() -> None:
    """Slack below zero: the request is behind because its realized gains fell short of what
    was expected (or others' drafts cost it), so its own expected gain does not count."""
    behind = np.array([-0.01, 1.0])
    assert trim_to_floor(np.array([1, 1]), np.array([[0.99], [0.9]]), behind, np.inf, extra(2), PLAIN_S).tolist() == [0, 0]
    ahead = np.array([0.003, 1.0])
    assert trim_to_floor(np.array([1, 1]), np.array([[0.5], [0.9]]), ahead, np.inf, extra(2), PLAIN_S).tolist() == [1, 1], \
        "its slack covers the other's draft (2 ms), then its own draft's gain (0.5 x 40 ms) the pass's 4 ms"


def reference_trim(verified, survival, slack, plain_slack, extra_s, plain_s) -> np.ndarray:
    """Drafts in order of falling survival (shallower first on ties), the longest run of
    them whose every prefix satisfies each request's constraint, checked directly: a
    request with slack ends the step with slack >= 0 in expectation, one behind (or a plain
    request without slack) pays nothing."""
    rows, depths = np.nonzero(np.arange(survival.shape[1]) < verified[:, None])
    order = sorted(range(len(rows)), key=lambda i: (-survival[rows[i], depths[i]], depths[i]))
    ahead = slack >= 0.0
    kept = np.zeros_like(verified)
    for i in order:
        trial = kept.copy()
        trial[rows[i]] += 1
        gain = np.array([survival[r, : trial[r]].sum() * plain_s for r in range(len(verified))])
        cost = extra_s[trial.sum()]
        if cost > 0.0 and ((~ahead).any() or plain_slack < cost or np.any(slack[ahead] + gain[ahead] < cost)):
            break
        kept = trial
    return kept


def random_case(rng: np.random.Generator) -> tuple:
    requests, k = rng.integers(1, 6), rng.integers(1, 5)
    survival = np.cumprod(rng.uniform(0.0, 1.0, (requests, k)), axis=1)
    verified = rng.integers(0, k + 1, requests)
    slack = rng.normal(0.005, 0.01, requests)
    plain_slack = np.inf if rng.random() < 0.3 else rng.normal(0.01, 0.01)
    extra_s = np.r_[0.0, np.cumsum(rng.uniform(0.0, 0.01, int(verified.sum())))]
    return verified, survival, slack, plain_slack, extra_s


def test_the_trim_matches_its_direct_reference() -> None:
    rng = np.random.default_rng(0)
    trimmed = 0
    for _ in range(400):
        case = random_case(rng)
        kept = trim_to_floor(*case, PLAIN_S)
        assert kept.tolist() == reference_trim(*case, PLAIN_S).tolist()
        trimmed += int(case[0].sum() - kept.sum())
    assert trimmed > 0, "the cases exercise the trim"


def test_whether_a_draft_is_kept_never_reads_its_deeper_confidences() -> None:
    """Non-anticipation: the k-th draft's fate is the same whatever the survival of the
    same request's deeper drafts (which read the k-th token)."""
    rng = np.random.default_rng(1)
    for _ in range(400):
        verified, survival, slack, plain_slack, extra_s = random_case(rng)
        kept = trim_to_floor(verified, survival, slack, plain_slack, extra_s, PLAIN_S)
        row = rng.integers(len(verified))
        depth = rng.integers(survival.shape[1])
        changed = survival.copy()
        tail = survival.shape[1] - depth - 1
        changed[row, depth + 1:] = survival[row, depth] * np.cumprod(rng.uniform(0.0, 1.0, tail))
        again = trim_to_floor(verified, changed, slack, plain_slack, extra_s, PLAIN_S)
        assert (kept[row] > depth) == (again[row] > depth)


def serve_one_copying_request(floor: float | None, steps: int = 600) -> tuple[float, VerificationController]:
    """Four requests; "copier" has an n-gram continuation of 3 tokens on every step and
    accepts all of them, the other three never have a proposal (plain requests of the
    pass). Steps cost what the profile says plus 2 ms per verified draft. Returns the plain
    requests' speed over plain decoding (tokens x plain step / their time)."""
    options = PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points, recalibrate=False,
                            measure_step_overhead=False, max_user_slowdown=floor, hybrid_ngram=True)
    ctrl = VerificationController(options, STARTUP_CURVE, num_speculative_tokens=7)
    everyone, plain_ids = ("copier", "p1", "p2", "p3"), ("p1", "p2", "p3")
    plain_step, now, elapsed = STARTUP_CURVE.step_time(4), 0.0, 0.0
    for step in range(steps):
        ctrl.step_started(now)
        inputs = StepInputs(("copier",), np.zeros((1, 7)), np.array([3]), np.ones(1, bool), base_tokens=3,
                            plain_requests=3, ngram_matches=np.array([6]), plain_ids=plain_ids)
        verified = ctrl.decide(inputs).verified if step else np.zeros(1, np.int64)  # step 0: a plain reference
        tokens = 4 + int(verified.sum())
        ctrl.step_scheduled(now, tokens, num_requests=4, pass_ids=everyone)
        ctrl.observe(verified + 1 if step else None)
        ctrl.plan_drafting(4, everyone)
        seconds = STARTUP_CURVE.step_time(tokens) + EXTRA_PER_DRAFT_S * int(verified.sum())
        now += seconds
        elapsed += seconds
    return steps * plain_step / elapsed, ctrl


def test_requests_without_proposals_stay_within_the_allowance() -> None:
    """Without the floor the copier's continuations are verified on every step and the other
    three users decode well below plain decoding; with it they lose at most the allowance."""
    unguarded, _ = serve_one_copying_request(None)
    guarded, ctrl = serve_one_copying_request(0.03)
    assert unguarded < 0.9
    assert guarded >= 0.97 - 0.005 and ctrl.stats.user_floor_trimmed > 0
    assert ctrl.stats.ngram_verified > 0, "the copier still verifies where the others have slack"


def test_drafting_pauses_while_a_request_of_the_pass_is_behind() -> None:
    ctrl = VerificationController(PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points),
                                  STARTUP_CURVE, num_speculative_tokens=7)
    assert ctrl.plan_drafting(2, ("a", "b")).depth == 7, "nothing known yet: drafts all K"
    ctrl.user_ledger.add(("b",), np.array([1.0]), plain_step_s=0.04, measured_s=0.08)
    assert ctrl.plan_drafting(2, ("a", "b")).depth == 0 and ctrl.stats.user_floor_paused_steps == 1
    assert ctrl.plan_drafting(1, ("a",)).depth == 7, "b is not in this pass"
    off = VerificationController(PluginOptions(policy="dspark", sps_table=STARTUP_CURVE.points, max_user_slowdown=None),
                                 STARTUP_CURVE, num_speculative_tokens=7)
    assert off.user_ledger is None and off.plan_drafting(2, ("a", "b")).depth == 7
