"""The verification controller: every per-step decision of the plugin, without vLLM.

Built once from the validated plugin options, it owns all state that lives across steps
(the policy object, live recalibration per sampling mode, the learned model of the step
time and the verifications waiting for their outcome) and is driven through a small loop:

    step_started(now)          time since the previous step -> the step-time model
    decide(StepInputs)         confidences of the drafting requests -> VerifyDecision
    step_scheduled(...)        what the engine really scheduled (it may cut drafts further)
    observe(emitted)           tokens each request emitted -> acceptance, recalibration

    admit_drafter(R)           whether a request joining R requests in the engine gets
                               the drafter at all (scheduling/drafter_ledger.py)
    plan_drafting(R, E)        how deep the next step drafts (0: not at all) and where the
                               drafter may stop a request early (E of the R have the drafter)
    observe_drafting(report)   what that drafting cost -> the drafting cost model
    prefer_ngram(...)          hybrid: which requests take their n-gram continuation
                               instead of the drafter's block (scheduling/hybrid.py)

The engine's scheduler (`integration/scheduler.py`) gathers the inputs from vLLM and
applies the lengths; the simulator (`benchmarks/simulate_scheduling.py`) drives the very
same class over recorded draft rounds.

Whether and how deep to draft: for depth d = 0..K the controller predicts the next step's
throughput R * (1 + a_1 + ... + a_d) / (s T(R + R d) + o + D(R, d)), with a_j the
recent mean calibrated prefix survival per position, T the profiled step, s and o the scale
and offset that map it to the measured steps (drafting left out; scheduling/overhead.py),
and D the drafting time, learned live by least squares on the drafter's own timings, and
drafts the best d. Until every position has been drafted once it drafts all K. Once every
`PROBE_INTERVAL` steps it probes instead, by turns one position deeper than the best d
(if d < K) and not at all (if d > 0); while the best d stays 0 the interval doubles after
each probe, up to `MAX_PROBE_INTERVAL`. Each load (requests in the pass, in the powers of
two of the realized-speed check) keeps its own probe clock: with one clock, a wave's ramp
and tail, at loads where drafting paid, reset the interval to 16 for the load where it did
not. (In the serving frontier at 4 requests that moved the share of steps dspark drafted
from 8% to 7% while the check kept 91-93% plain: the rest is most likely the drafting after each lifted veto.)
At 16 requests on a CPU, where plain decoding
won, the probes drafted on 6% of the steps (every 16th), each such step about 1.4x a
plain one (fixed k = 1 in `benchmarks/results/drafting_breakdown.md`); the backoff takes
that below 1% after a few hundred steps, and a change of load needs no probe (the best d
is recomputed every step from the models). The deeper probe keeps the survival estimate
there fresh: an early stop under a heavier load leaves low survival (the rows it stopped count
as 0), which would otherwise never be re-measured once the load falls. The plain probe
shows the step-time model what a step without drafts costs: steps that all carry drafts
have nearly the same profiled size, so the model could only extrapolate to plain steps
(measured at 4 requests: 48 ms plain steps predicted as 56, and drafting on 99% of the
steps at 0.87x plain decoding).

The model is checked against what speculating realizes (`check_realized_speed`,
scheduling/realized.py): at a load where recent speculative steps measured less
per-request speed than plain steps there, on average or for some request, the controller
neither drafts nor verifies until its probes (which go on, with the same backoff) measure
otherwise.

Exactness: the lengths of a step depend on that step's confidences through the policy
(non-anticipating, DSPARK.md section 4) and on state learned from earlier steps only.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import hybrid
from vllm_dspark.scheduling.drafter_ledger import DrafterLedger
from vllm_dspark.scheduling.overhead import StepTimeModel, applied_model
from vllm_dspark.scheduling.policies import (
    Admission,
    FixedPolicy,
    PolicyStep,
    VerifyPolicy,
    admit_top_budget,
    decide_lengths,
    policy_from_options,
)
from vllm_dspark.scheduling.ranking import SpsFunction
from vllm_dspark.scheduling.realized import DrafterRole, RealizedSpeed, StepRecord, load_bucket
from vllm_dspark.scheduling.recalibration import OnlineRecalibrator
from vllm_dspark.scheduling.sps import SpsCurve
from vllm_dspark.scheduling.stats import DSparkStats

logger = logging.getLogger(__name__)

# Live recalibration learns greedy and sampled requests apart: a greedy request accepts a
# draft only if it is the target's argmax, a sampled one with probability min(1, p/q).
SAMPLING_MODES = ("greedy", "sampled")
# Verifications in flight at once (one per scheduled step; several under pipelining).
MAX_IN_FLIGHT = 16
# Once every this many steps the drafting depth is probed: one position deeper than the
# best, or none (by turns; see the module docstring).
PROBE_INTERVAL = 16
# While not drafting stays the best, each deeper probe doubles the wait for the next one,
# up to this many steps (a probe that does not pay costs most under the heaviest load).
MAX_PROBE_INTERVAL = 128
# Weight of each drafted step in the moving average of drafting seconds per step.
DRAFTING_SMOOTHING = 0.1
# Weight of each drafted step in the per-position survival estimate.
SURVIVAL_SMOOTHING = 0.2
# Recent calibrated first confidences kept for the hybrid's skip rule (hybrid.DrafterSkip),
# per continuation key, and how many of their quantiles it receives.
RECENT_FIRST_CONFIDENCES = 128
FIRST_CONFIDENCE_LEVELS = (np.arange(16) + 0.5) / 16


@dataclass(frozen=True)
class DraftPlan:
    """How the next step drafts."""

    depth: int  # draft positions per request (0: no drafting, only the drafter's context)
    min_survival: float  # a request stops drafting once its prefix survival falls below this
    # Hybrid: when the worker may leave the drafter out for n-gram continuations (None: never).
    drafter_skip: hybrid.DrafterSkip | None = None
    # False: the measured check keeps the next step plain, so nothing proposed now is verified.
    verifies: bool = True


class DraftingCost:
    """Drafting seconds per step ~ w . [R, [d > 0], R * d, LM-head rows], fitted online by
    recursive least squares with forgetting: the context pass costs per request (at
    d = 0 it is only queued, and the next drafting step writes the queue: the fixed term
    takes that in), the drafter's forward pass a fixed price once it runs at all (launches,
    metadata, the host side) plus a price per query token, the LM head per computed row.

    The fixed term is what a CPU shows at one request: 1 ms for the context pass alone and
    7.7 ms at depths 1, 2 and 3 alike (drafting flat in depth). Without it the least
    squares spread that jump over the per-position terms, priced depth 3 above depth 2
    and drafted too shallow (1.27x plain decoding, where fixed k = 3 gave 1.44x).

    The prior is weak (ridge 1 / prior): what tells the fixed price from the per-position
    ones are the depth probes, a few steps in each forgetting window, and a strong ridge
    would outweigh them and spread the cost over the largest regressors (R d, rows)."""

    def __init__(self, forgetting: float = 0.98, prior: float = 1e2) -> None:
        self.forgetting = forgetting
        self.weights = np.zeros(4)
        self.covariance = np.eye(4) * prior
        self.samples = 0

    @staticmethod
    def features(num_requests: int, depths: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """[len(depths), 4] regressors; `rows` defaults to every request drafting each depth in full.
        Filled column by column (np.stack costs more than the product; the plan asks every step)."""
        depths = np.asarray(depths, dtype=np.float64)
        x = np.empty((len(depths), 4))
        x[:, 0] = num_requests
        x[:, 1] = depths > 0
        x[:, 2] = num_requests * depths
        x[:, 3] = x[:, 2] if rows is None else rows
        return x

    def observe(self, num_requests: int, depth: int, rows: int, seconds: float) -> None:
        x = self.features(num_requests, np.array([depth]), np.array([rows]))[0]
        px = self.covariance @ x
        gain = px / (self.forgetting + x @ px)
        self.weights += gain * (seconds - x @ self.weights)
        self.covariance = (self.covariance - np.outer(gain, px)) / self.forgetting
        self.samples += 1

    def predict(self, num_requests: int, depths: np.ndarray) -> np.ndarray:
        """Seconds for each depth, counting every request's rows up to it (no early stop)."""
        return np.maximum(0.0, self.features(num_requests, depths) @ self.weights)


@dataclass(frozen=True)
class StepInputs:
    """The drafting requests of one step, as the engine (or the simulator) sees them."""

    req_ids: tuple[str, ...]
    confidences: np.ndarray  # [R, K] conditional confidences as drafted, 0 where no draft
    proposed: np.ndarray  # [R] drafts available per request
    greedy: np.ndarray  # [R] bool: the request samples greedily
    base_tokens: int = 0  # other tokens of the same pass: prefill chunks, `plain_requests`
    min_tokens_per_s: np.ndarray | None = None  # [R] per-request speed floors (sla)
    plain_requests: int = 0  # decoding requests of the pass with no proposal (PolicyStep)
    missing: int = 0  # requests whose drafts came without confidences (rows of zeros)
    # [R] matched suffix length where the proposal is an n-gram continuation, 0 where it
    # is the drafter's (then `confidences` holds the drafter's row); None: no n-gram rows.
    ngram_matches: np.ndarray | None = None


@dataclass(frozen=True)
class VerifyDecision:
    """What the policy decided in one step."""

    req_ids: tuple[str, ...]
    proposed: np.ndarray  # [R]
    verified: np.ndarray  # [R] drafts kept for verification
    confidences: np.ndarray  # [R, K] the confidences the policy used (after recalibration)
    base_tokens: int
    plain_requests: int = 0


@dataclass(frozen=True)
class _Pending:
    """A scheduled step's verifications, kept until its output shows what was accepted."""

    req_ids: tuple[str, ...]
    raw_confidences: np.ndarray  # [R, K] as drafted (after the invalid-value fallback)
    greedy: np.ndarray  # [R]
    verified: np.ndarray  # [R] as scheduled
    predicted: np.ndarray  # [R] expected accepted drafts (sum of calibrated survival)
    ngram_matches: np.ndarray  # [R] as in StepInputs (0: a drafter proposal)
    record: StepRecord | None  # the step for the realized-speed check (None: not timed)
    num_requests: int  # requests in the pass (0: unknown)
    with_drafter: int  # of them, those admitted with the drafter


@dataclass
class _ProbeClock:
    """One load's probing: steps since its last probe, the wait for the next (backs off
    while not drafting is best there) and which probe comes next where both apply."""

    steps_since: int = 0
    interval: int = PROBE_INTERVAL
    deeper: bool = True


def linear_quantiles(values, levels: np.ndarray) -> np.ndarray:
    """np.quantile's default (linear) quantiles of a short sample, without its overhead of
    about 40 us a call: the drafter skip takes them for every situation on every planned step."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    position = np.asarray(levels) * (len(ordered) - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def _flat_curve(batch_tokens: np.ndarray) -> np.ndarray:
    """Stand-in SPS for policies that ignore the curve (fixed, threshold)."""
    return np.ones_like(np.asarray(batch_tokens, dtype=np.float64))


class VerificationController:
    def __init__(
        self,
        options: PluginOptions,
        curve: SpsCurve | None,
        *,
        num_speculative_tokens: int = 0,
        can_time_steps: bool = True,
        admission: Admission = admit_top_budget,
    ) -> None:
        """`curve` is the resolved SPS profile (None if there is none); `can_time_steps`
        is False where the time between steps is not one step (pipeline parallelism);
        `num_speculative_tokens` is K, the deepest draft (0: the caller plans no drafting)."""
        self.options = options
        self.curve = curve
        self.block = num_speculative_tokens
        self.policy: VerifyPolicy = policy_from_options(options, admission)
        if self.policy.needs_curve and curve is None:
            logger.warning(
                "vllm_dspark: policy '%s' needs an SPS profile and none was found; verifying with "
                "'fixed' (all drafts) until one exists", options.policy,
            )
            self.policy = FixedPolicy(options.k)
        # The curve the policies use: the profile mapped by the learned step-time model, with
        # the drafting of a step added.
        self.policy_curve: SpsFunction = curve if curve is not None else _flat_curve
        self.step_time = StepTimeModel()
        self.learns_step_time = options.measure_step_overhead and can_time_steps and curve is not None
        self._model = (1.0, 0.0)  # (scale, offset) as applied to the curve
        self._policy_model = (1.0, 0.0)  # (scale, offset + drafting) policy_curve was built with
        # Profiled steps at which a model change is judged big enough to rebuild policy_curve.
        self._anchor_steps = (
            None if curve is None else (curve.min_step_time, float(curve.step_time(curve.points[-1][0])))
        )
        self.recalibrators = (
            {mode: OnlineRecalibrator(learning_rate=options.recalibration_rate) for mode in SAMPLING_MODES}
            if options.recalibrate
            else {}
        )
        self.ngram = hybrid.NgramConfidence(self.block) if options.hybrid_ngram and self.block else None
        # The drafter's recent calibrated c_1 on drafted steps by the request's continuation
        # key (hybrid: the skip rule's prior).
        self._first_confidences = [deque(maxlen=RECENT_FIRST_CONFIDENCES) for _ in range(hybrid.CONTINUATION_KEYS)]
        # Their quantiles per key, each kept until its key has new values (`_stale_keys`).
        self._first_quantiles = np.zeros((hybrid.CONTINUATION_KEYS, len(FIRST_CONFIDENCE_LEVELS)))
        self._stale_keys = set(range(hybrid.CONTINUATION_KEYS))
        self.stats = DSparkStats(policy=self.policy.name)
        # (start time, tokens in the pass, its record for the realized-speed check) of the
        # decode step in flight; None: not timed
        self._previous_step: tuple[float, int, StepRecord | None] | None = None
        # The measured check on speculating (None: off, or steps cannot be timed) and
        # whether it blocks the next step's verification.
        checks = options.check_realized_speed and options.adaptive_drafting and can_time_steps and curve is not None
        checks_drafter = self.ngram is not None and options.check_drafter_against_ngram
        self.realized = RealizedSpeed(options.check_each_request, checks_drafter) if checks else None
        # Steps of the drafter check's reference still to plan: two without the drafter, then
        # the one after them (realized.py).
        self._drafter_reference_left = 0
        self._verification_vetoed = False
        # This step's decision with its prefix survival, raw confidences, greedy mask and
        # n-gram match lengths.
        self._decision: tuple[VerifyDecision, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._pending: deque[_Pending | None] = deque(maxlen=MAX_IN_FLIGHT)
        # Drafting: its cost model, its recent measured time, the recent mean survival per
        # position (None until a drafted step was seen) and the step (counted by
        # `_planned_steps`) that last measured each position (-inf: none yet).
        self.drafting_cost = DraftingCost()
        self.drafting_seconds = 0.0
        self._drafting_in_step = 0.0  # drafting measured since the current step started
        self._drafted_in_step = False  # a drafter pass (depth > 0) ran since then
        self.mean_survival: np.ndarray | None = None
        self._survival_seen_at = np.full(self.block, -np.inf)
        self._planned_steps = 0
        self._probe_clocks: dict[int, _ProbeClock] = {}  # per load bucket
        # The drafter's measured balance per load, which admits requests with or without it
        # (None: every request has it). Its gains are valued with the step-time model.
        self.ledger = (DrafterLedger() if options.drafter_admission and options.adaptive_drafting
                       and self.block and curve is not None else None)

    @property
    def _checks_drafter(self) -> bool:
        """The hybrid's drafter is checked against n-gram proposals alone (realized.py)."""
        return self.realized is not None and self.realized.drafter_against_ngram

    # ------------------------------------------------------------ the step
    def step_started(self, now: float) -> None:
        """Time since the previous step started = that step's wall time (the schedule ->
        execute -> update loop); less the drafting measured in it, it is compared with the
        profile at that pass size."""
        drafting, self._drafting_in_step = self._drafting_in_step, 0.0
        drafted, self._drafted_in_step = self._drafted_in_step, False
        if self._previous_step is None:
            return
        started, tokens, record = self._previous_step
        if record is not None and self.realized is not None:
            record.seconds, record.drafting_s, record.drafted = now - started, drafting, drafted
            self.realized.add(record)
        if not self.learns_step_time:
            return
        assert self.curve is not None
        if not self.step_time.observe(now - started - drafting, self.curve.step_time(tokens)):
            return
        self._model = applied_model(self.curve, self.step_time.scale, self.step_time.offset)
        self.stats.step_time_scale, offset = self._model
        self.stats.step_overhead_ms = 1000.0 * offset
        self._refresh_policy_curve()

    def _refresh_policy_curve(self) -> None:
        """Rebuild the policies' curve when the model moved its steps by more than 2%
        (rebuilding every step would cost more than the precision is worth)."""
        assert self.curve is not None and self._anchor_steps is not None
        scale, offset = self._model
        model = (scale, offset + self.drafting_seconds)
        # The two models' steps at the anchors, in Python floats (this runs every timed step).
        new = [model[0] * step + model[1] for step in self._anchor_steps]
        old = [self._policy_model[0] * step + self._policy_model[1] for step in self._anchor_steps]
        if any(abs(n - o) > 0.02 * o for n, o in zip(new, old)):
            self.policy_curve = self.curve.with_step_model(*model)
            self._policy_model = model

    def decide(self, step: StepInputs) -> VerifyDecision:
        """Verification lengths of the drafting requests of this step."""
        self.stats.missing_confidences += step.missing
        raw = self._valid_confidences(step.confidences)
        confidences = self._recalibrated(raw, step.greedy)
        matches = np.zeros(len(step.req_ids), dtype=np.int64) if step.ngram_matches is None else step.ngram_matches
        ngram = matches > 0
        if ngram.any() and self.ngram is not None:
            # An n-gram row's confidences are its learned acceptance, not the drafter's.
            width = confidences.shape[1]
            confidences[ngram] = self.ngram.conditional(matches[ngram], step.proposed[ngram], step.greedy[ngram])[:, :width]
        policy_step = PolicyStep(confidences, self.policy_curve, step.base_tokens, step.min_tokens_per_s,
                                 step.plain_requests)
        verified = np.minimum(decide_lengths(self.policy, policy_step), step.proposed)
        if self._verification_vetoed:  # n-gram rows on a step the check keeps plain
            verified = np.zeros_like(verified)
        decision = VerifyDecision(step.req_ids, step.proposed, verified, confidences, step.base_tokens,
                                  step.plain_requests)
        survival = np.cumprod(confidences, axis=1)
        self._track_survival(survival[~ngram], step.proposed[~ngram])
        self._decision = (decision, survival, raw, step.greedy, matches)
        return decision

    def step_scheduled(
        self,
        started: float,
        total_tokens: int,
        scheduled_drafts: dict[str, int] | None = None,
        prefill_tokens: int = 0,
        num_requests: int = 0,
        with_drafter: int | None = None,
    ) -> None:
        """Close the step: `scheduled_drafts` (request -> drafts the engine scheduled; None =
        as decided) replaces the planned lengths, since the engine may cut drafts further
        (token budget, model length) and an unscheduled draft was never judged.
        `prefill_tokens` of the pass are prompt tokens: such a step is not timed for the
        step-time model (the profile times decode passes; see scheduling/overhead.py).
        `num_requests` in the pass (0: unknown) keys the realized-speed check and the
        drafter's ledger; `with_drafter` of them have the drafter (None: all)."""
        timed = bool(total_tokens) and not prefill_tokens
        decision, self._decision = self._decision, None
        verified = np.zeros(0, dtype=np.int64)
        if decision is not None:
            decided, survival, raw, greedy, matches = decision
            verified = decided.verified
            if scheduled_drafts is not None:
                verified = np.minimum(verified, [scheduled_drafts.get(r, 0) for r in decided.req_ids])
        record = None
        if self.realized is not None and timed and num_requests > 0:
            assert self.curve is not None
            verifies = bool(verified.sum())  # else its tokens are one per request, known now
            request_ids = decision[0].req_ids if decision is not None else ()
            record = StepRecord(num_requests, self.curve.step_time(num_requests), verifies,
                                tokens=None if verifies else num_requests, request_ids=request_ids,
                                request_tokens=None if verifies else np.ones(len(request_ids)),
                                verified_drafter=(self._checks_drafter and decision is not None
                                                  and bool(verified[matches == 0].sum())),
                                kept_plain=self._verification_vetoed)
        pending = None
        if decision is not None:
            predicted = np.where(np.arange(survival.shape[1]) < verified[:, None], survival, 0.0).sum(axis=1)
            self.stats.record_decision(decided.proposed, verified, matches > 0)
            pending = _Pending(decided.req_ids, raw, greedy, verified, predicted, matches, record, num_requests,
                               num_requests if with_drafter is None else with_drafter)
        self._pending.append(pending)
        self._previous_step = (started, total_tokens, record) if timed else None

    def awaiting_outcome(self) -> tuple[str, ...]:
        """Requests of the oldest scheduled step whose outcome `observe` takes next."""
        return self._pending[0].req_ids if self._pending and self._pending[0] is not None else ()

    def observe(self, emitted: np.ndarray | None) -> None:
        """Outcome of the oldest scheduled step: tokens each request of `awaiting_outcome()`
        emitted (-1 where it produced no output). The target emits the accepted drafts
        plus one token of its own."""
        pending = self._pending.popleft() if self._pending else None
        if pending is None or emitted is None:
            return
        emitted = np.asarray(emitted)
        verified = np.where(emitted < 0, 0, pending.verified)  # no output: nothing was judged
        accepted = np.minimum(np.maximum(emitted - 1, 0), verified)
        self.stats.accepted += int(accepted.sum())
        if pending.record is not None and self.realized is not None and pending.record.tokens is None:
            pending.record.tokens = pending.record.requests + int(accepted.sum())
            pending.record.request_tokens = np.where(emitted < 0, np.nan, emitted)
            self.realized.add(pending.record)
        self.stats.predicted_accepted += float(pending.predicted[verified > 0].sum())
        ngram = pending.ngram_matches > 0
        if ngram.any() and self.ngram is not None:
            self.stats.ngram_accepted += int(accepted[ngram].sum())
            judged = ngram & (verified > 0)
            self.ngram.observe(pending.ngram_matches[judged], pending.greedy[judged], verified[judged], accepted[judged])
        for mode, recalibrator in self.recalibrators.items():
            rows = (pending.greedy == (mode == "greedy")) & ~ngram
            if rows.any():
                recalibrator.observe(pending.raw_confidences[rows], verified[rows], accepted[rows])
        drafter_verified = int(verified[~ngram].sum()) if self.ledger is not None and pending.num_requests else 0
        if drafter_verified:
            # What the drafter's verified blocks added to the pass, and what each accepted
            # draft saved: a plain pass's seconds per request (drafter_ledger.py).
            requests, pass_tokens = pending.num_requests, pending.num_requests + int(verified.sum())
            without, with_blocks, plain = self._pass_seconds(
                np.array([pass_tokens - drafter_verified, pass_tokens, requests]))
            self.ledger.observe_outcome(requests, pending.with_drafter, int(accepted[~ngram].sum()),
                                        float(with_blocks - without), float(plain) / requests)

    # --------------------------------------------------------------- drafting
    def admit_drafter(self, num_requests: int) -> bool:
        """Whether a request joining `num_requests` requests in the engine (itself
        included) gets the drafter for its life, judged by the ledger of passes that size
        (drafter_ledger.py); counted when it does not."""
        if self.ledger is None or self.ledger.admits(num_requests):
            return True
        self.stats.requests_without_drafter += 1
        return False

    def plan_drafting(self, num_requests: int, with_drafter: int | None = None) -> DraftPlan:
        """How deep the step just scheduled drafts for `num_requests` requests, of which
        `with_drafter` (None: all) were admitted with the drafter (its drafts are verified
        in the next step), from past steps only (the drafts it plans do not exist yet, so
        this cannot anticipate them)."""
        with_drafter = num_requests if with_drafter is None else with_drafter
        self._planned_steps += 1
        self._verification_vetoed = False
        if self._drafter_reference_left == 1:  # it drafts, but verifies none of the drafter's drafts
            self._drafter_reference_left = 0
            self._mark_step(DrafterRole.BESIDE_REFERENCE)
        depth = self.policy.max_draft_depth(self.block)
        if not self.options.adaptive_drafting:
            self.stats.record_plan(depth)
            return DraftPlan(depth, 0.0, self._drafter_skip(num_requests, depth))
        if self.realized is not None and num_requests and self.realized.reference_due(num_requests):
            # A plain step, so that the check has a reference at this load (realized.py).
            self._verification_vetoed = True
            self.stats.reference_steps += 1
            self.stats.record_plan(0)
            return DraftPlan(0, 0.0, None, verifies=False)
        if self._checks_drafter and num_requests and (
                self._drafter_reference_left or self.realized.drafter_reference_due(num_requests)):
            # Two steps without the drafter, n-gram continuations verified: the first still
            # verifies its drafts, the second is the reference (realized.py).
            self._drafter_reference_left = (self._drafter_reference_left or 3) - 1
            self._mark_step(DrafterRole.REFERENCE if self._drafter_reference_left == 1 else DrafterRole.BESIDE_REFERENCE)
            self.stats.drafter_reference_steps += 1
            self.stats.record_plan(0)
            return DraftPlan(0, 0.0, None)
        if not with_drafter:  # no request of the pass could verify a draft
            self.stats.record_plan(0)
            return DraftPlan(0, 0.0, None)
        floor = self.policy.min_survival(self.policy_curve, num_requests, self.block)
        known = self.mean_survival is not None and bool(np.isfinite(self._survival_seen_at[:depth]).all())
        probing = False
        if self.policy.adaptive_depth and self.curve is not None and known and num_requests:
            vetoed = self.realized is not None and self.realized.vetoes(num_requests)
            # Hybrid: the drafter alone may be vetoed, n-gram continuations still verified.
            drafter_vetoed = not vetoed and self._checks_drafter and self.realized.drafter_vetoes(num_requests)
            best = self._best_depth(num_requests, depth, with_drafter)
            probe = self._probed_depth(0 if vetoed or drafter_vetoed else best, depth, num_requests)
            if vetoed and probe:
                # A probe under a veto tests what the model would do. With n-gram
                # continuations that can be verifying them without drafting: a probe that
                # drafted anyway would charge a drafter pass the model would not run to
                # the gains that lift the veto (at 16 requests on code that pass held a
                # veto for eight turns where copying paid 1.07x; closed_loop/README.md).
                depth, probing = best or (0 if self.ngram is not None else probe), False
            elif drafter_vetoed and probe:  # the drafter's own probe: it drafts, never left out
                depth, probing = max(probe, best), True
            else:
                depth, probing = probe, probe != best
            # A probe's proposals are verified as usual; otherwise nothing is, n-gram rows included.
            self._verification_vetoed = vetoed and not probe
            self.stats.vetoed_steps += int(self._verification_vetoed)
            self.stats.drafter_vetoed_steps += int(drafter_vetoed and depth == 0)
        self.stats.record_plan(depth)
        # A probe measures the drafter, so the worker must not leave it out.
        skip = None if probing else self._drafter_skip(num_requests, depth)
        return DraftPlan(depth, floor if depth else 0.0, skip, verifies=not self._verification_vetoed)

    def _mark_step(self, role: DrafterRole) -> None:
        """Tell the drafter's check what the step just scheduled (if timed) samples."""
        if self._previous_step is not None and self._previous_step[2] is not None:
            self._previous_step[2].drafter_role = role

    def _drafter_skip(self, num_requests: int, depth: int) -> hybrid.DrafterSkip | None:
        """What the worker needs to leave the drafter out where the step is predicted to
        serve faster with n-gram continuations alone, from earlier steps only: the learned
        n-gram acceptance, the drafter's expectation at this depth over recent c_1 values,
        the pass time by drafts verified and the drafting time (hybrid.DrafterSkip)."""
        if (self.ngram is None or not depth or not num_requests or not self.options.ngram_skips_drafter
                or self.mean_survival is None or self.curve is None or not any(self._first_confidences)):
            return None
        if self._stale_keys:  # new c_1 values since the last plan (drafted steps only)
            # A key not seen yet takes every key's values, so it is stale whenever any key is.
            empty = {key for key, recent in enumerate(self._first_confidences) if not recent}
            pooled = [c for recent in self._first_confidences for c in recent] if empty else []
            for key in self._stale_keys | empty:
                self._first_quantiles[key] = linear_quantiles(self._first_confidences[key] or pooled,
                                                              FIRST_CONFIDENCE_LEVELS)
            self._stale_keys.clear()
        first = self._first_quantiles
        expected = hybrid.drafter_expected(first.ravel(), depth, self.mean_survival).reshape(first.shape)
        drafting = self.drafting_cost.predict(num_requests, np.array([0, depth]))
        return hybrid.DrafterSkip(
            self.ngram.table(), depth, expected,
            self._pass_seconds(num_requests + np.arange(num_requests * self.block + 1)),
            float(drafting[1] - drafting[0]),
        )

    def _pass_seconds(self, batch_tokens: np.ndarray) -> np.ndarray:
        """Predicted seconds of decode passes of `batch_tokens` tokens, drafting left out:
        the profile mapped by the learned step-time model."""
        assert self.curve is not None
        scale, offset = self._model
        return scale * self.curve.step_time(batch_tokens) + offset

    def _probed_depth(self, best: int, max_depth: int, num_requests: int) -> int:
        """`best`, or a probe of it once every `PROBE_INTERVAL` steps at this load, less
        often while the best there is not to draft (module docstring)."""
        clock = self._probe_clocks.setdefault(load_bucket(num_requests), _ProbeClock())
        clock.steps_since += 1
        if best > 0:
            clock.interval = PROBE_INTERVAL
        if clock.steps_since < clock.interval or max_depth == 0:
            return best
        clock.steps_since = 0
        if best == 0:
            clock.interval = min(2 * clock.interval, MAX_PROBE_INTERVAL)
        deeper = best < max_depth and (clock.deeper or best == 0)
        clock.deeper = not deeper
        return best + 1 if deeper else 0

    def _best_depth(self, num_requests: int, max_depth: int, with_drafter: int) -> int:
        """argmax over d of predicted tokens per second when drafting d positions (for all
        `num_requests` requests, verified for the `with_drafter` that have the drafter)."""
        assert self.curve is not None and self.mean_survival is not None
        depths = np.arange(max_depth + 1)
        survival = self.mean_survival[:max_depth]
        tokens = num_requests + with_drafter * np.concatenate(([0.0], np.cumsum(survival)))
        step = self._pass_seconds(num_requests + with_drafter * depths) + self.drafting_cost.predict(num_requests, depths)
        return int(np.argmax(tokens / np.maximum(step, 1e-9)))

    def observe_drafting(
        self, num_requests: int, depth: int, lm_head_rows: int, seconds: float, skipped_for_ngram: bool = False,
        with_drafter: int | None = None,
    ) -> None:
        """What the last proposal cost (from the drafter's own timing); `skipped_for_ngram`:
        the worker left the drafter out for the requests' n-gram continuations;
        `with_drafter` of the requests have the drafter (None: all)."""
        self.stats.drafter_skipped_steps += int(skipped_for_ngram)
        if self.ledger is not None:
            self.ledger.observe_proposal(num_requests, num_requests if with_drafter is None else with_drafter,
                                         max(0.0, seconds))
        if num_requests <= 0 or seconds <= 0.0:
            return
        self.drafting_cost.observe(num_requests, depth, lm_head_rows, seconds)
        self._drafting_in_step += seconds
        self._drafted_in_step = self._drafted_in_step or depth > 0
        weight = 1.0 if self.drafting_cost.samples == 1 else DRAFTING_SMOOTHING
        self.drafting_seconds += weight * (seconds - self.drafting_seconds)
        self.stats.record_drafting(lm_head_rows, seconds)

    def prefer_ngram(
        self, first_confidence: np.ndarray, greedy: np.ndarray, proposals: hybrid.NgramProposals, drafted_depth: int,
        with_drafter: np.ndarray | None = None,
    ) -> np.ndarray:
        """[R] True where a request should verify its n-gram continuation rather than the
        drafter's block: `first_confidence` [R] is the drafter's raw c_1 (0 where it did not
        draft), `drafted_depth` the depth planned for the drafts, `with_drafter` [R] marks
        the requests admitted with the drafter (None: all; the others take any continuation,
        and their blocks, drafted without their context, teach nothing). Reads nothing the
        drafter drew, so the choice keeps verification exact (scheduling/hybrid.py)."""
        if self.ngram is None:
            return np.zeros(len(greedy), dtype=bool)
        with_drafter = np.ones(len(greedy), dtype=bool) if with_drafter is None else np.asarray(with_drafter)
        raw = self._valid_confidences(np.asarray(first_confidence)[:, None], count=False)  # decide() counts them
        first = self._recalibrated(raw, greedy)[:, 0]
        if drafted_depth and with_drafter.any():  # new c_1 values: their keys' quantiles are stale
            keys = hybrid.continuation_keys(proposals)
            for key in np.unique(keys[with_drafter]).tolist():
                self._first_confidences[key].extend(first[with_drafter & (keys == key)].tolist())
                self._stale_keys.add(key)
        conditional = self.ngram.conditional(proposals.matches, proposals.lengths, greedy)
        preferred = ~with_drafter | hybrid.prefer_ngram(conditional, first, drafted_depth, self.mean_survival)
        return (proposals.lengths > 0) & preferred

    def _track_survival(self, prefix_survival: np.ndarray, proposed: np.ndarray) -> None:
        """Mean calibrated prefix survival per position of the requests drafting now.

        A position averages only the requests with a draft there (`proposed` [R]): drafts
        the engine cut (the end of max_tokens or of the model length) say nothing about
        survival, and counting them as 0 would keep the deeper positions from ever being
        drafted again. A request the drafter stopped early keeps its drafts' slots and
        counts with 0 there: below what this load would verify. Positions no request
        reached keep their earlier estimate; a position first measured, or measured again
        after `PROBE_INTERVAL` steps without it (a probe), takes the new value as is, since
        the old one is stale. Steps, not drafted steps: while not drafting, probes come
        `PROBE_INTERVAL` or more steps apart and each replaces the estimate, so one probe
        that finds the drafts surviving again is enough to resume drafting."""
        if not len(prefix_survival) or not prefix_survival.shape[1]:
            return
        drafted = prefix_survival.shape[1]
        present = np.arange(drafted) < np.asarray(proposed)[:, None]
        counts = present.sum(axis=0)
        seen = counts > 0
        survival = np.where(present, prefix_survival, 0.0).sum(axis=0)[seen] / counts[seen]
        if self.mean_survival is None or len(self.mean_survival) < drafted:
            known = 0 if self.mean_survival is None else len(self.mean_survival)
            self.mean_survival = np.r_[self.mean_survival if known else [], np.zeros(max(self.block, drafted) - known)]
            self._survival_seen_at = np.r_[self._survival_seen_at[:known], np.full(len(self.mean_survival) - known, -np.inf)]
        positions = np.flatnonzero(seen)
        stale = self._planned_steps - self._survival_seen_at[positions] > PROBE_INTERVAL
        weight = np.where(stale, 1.0, SURVIVAL_SMOOTHING)
        self.mean_survival[positions] += weight * (survival - self.mean_survival[positions])
        self._survival_seen_at[positions] = self._planned_steps

    def engine_idle(self) -> None:
        """No request left: the gap until the next one is not a step."""
        self._previous_step = None

    # --------------------------------------------------------------- helpers
    def _valid_confidences(self, confidences: np.ndarray, count: bool = True) -> np.ndarray:
        """NaN or out-of-range confidences are replaced by 0 (documented safe fallback:
        such a draft is not verified), counted and logged (`count`: once per step)."""
        matrix = np.asarray(confidences, dtype=np.float64)
        bad = ~np.isfinite(matrix) | (matrix < 0) | (matrix > 1)
        if not bad.any():
            return matrix
        if count:
            self.stats.invalid_confidences += int(bad.sum())
            logger.warning("vllm_dspark: %d invalid confidences (NaN/out of range) treated as 0", int(bad.sum()))
        return np.where(bad, 0.0, matrix)

    def _recalibrated(self, raw: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        confidences = raw.copy()
        for mode, recalibrator in self.recalibrators.items():
            rows = greedy == (mode == "greedy")
            if rows.any():
                confidences[rows] = recalibrator.apply(raw[rows])
        return confidences

    def refresh_gauges(self) -> None:
        """Copy the recalibration parameters into the stats (done when they are published,
        not every step)."""
        for mode, recalibrator in self.recalibrators.items():
            if recalibrator.judged.any():
                self.stats.confidence_slopes[mode] = recalibrator.slopes.round(4).tolist()
                self.stats.confidence_shifts[mode] = recalibrator.shifts.round(4).tolist()
