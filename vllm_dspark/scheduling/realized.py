"""The measured check on the controller's model: do speculative steps really beat plain ones?

The controller drafts and verifies where its model (calibrated survival, the profiled
step curve mapped by the learned step-time model, the drafting-cost fit) predicts more
tokens per second than plain decoding. Whatever that model leaves out (a rejection
sampler and draft bookkeeping dearer than a profiled token, survival over-estimated at
one load, verification that the step-time fit cannot tell apart from its scale within a
wave of one size) makes it speculate where plain decoding is faster. Measured so: at 4
requests dspark was predicted at 1.01x and ran at 0.93x plain decoding.

`RealizedSpeed` measures the outcome itself, per load (requests in the pass, in powers of
two). Steps that verify nothing give the bucket's reference, (measured step - the
drafting measured in it) / profiled step: under steady drafting every step drafts, so
plain steps come only from probes that verify nothing, and they draft too. Each
speculative step (drafts verified, or the drafter run in it) gives its realized gain,

    g = (tokens emitted / requests) x (reference x profiled plain step) / measured step,

the per-request speed of that step over a plain step at the same load. The controller
stops speculating at a load once the recent gains there lie below 1 with confidence (mean
plus `CONFIDENCE` standard errors), and goes on probing as it does when its model says
not to draft. The verdict then rests on the probes alone (the gains are cleared when it
changes): it lifts once the last `LIFT_PROBES` probes gained more than 1 by a standard
error (their steps alone, so that probes from before a change of regime do not hold it).
A probe does what the model would: with n-gram continuations and no depth worth drafting
it verifies them without a drafter pass (one that drafted a position anyway charged the
lifting gains a pass the model would not run, and held a veto for eight turns at 16
requests on code where copying paid 1.07x). The lift first came at the first probe above
1, which gains as widely spread as per-step gains reach by chance at a load losing
10-20%; then at least 8 more speculative steps went by before the next veto. Only past
steps enter, so outputs stay exact, as with every other input of the decision.

The mean over requests can gain while some request loses: requests whose drafts are
rarely accepted pay every speculative step's cost for about one token, so at 16 requests
on code the hybrid decoded 1.22x plain on average while its slowest request ran at 0.87x,
and a wave, which lasts until its slowest request is done, at 0.89x (serving frontier,
rotating prompts, 2026-12-04). So each request's gains are kept too, and a load is also
vetoed once some request's recent gains lie below 1 with confidence
(`REQUEST_CONFIDENCE` standard errors, `REQUEST_MIN_STEPS` of its speculative steps at
least): speculating must not make any user slower than plain decoding. The probes that
lift a veto are judged on their mean, as before (a request's few probe steps say little
about it). In the frontier run of 2026-12-04 18:37 UTC (64-token requests) this test never
fired: such a request lives fewer speculative steps at one load than it needs; it guards
long generations.

A load where every step verifies something has no reference: with n-gram proposals
(hybrid) some request has a continuation on nearly every step at 16 requests and more, and
the drafter's own probes to depth 0 still verify those. There the check could never veto
(serving frontier of 2026-12-03, 64 requests: the hybrid decoded at 0.83x plain and the
check never fired). So after `REFERENCE_INTERVAL` speculative steps at a load without a
plain one, `reference_due` asks the controller for one plain step (nothing drafted or
verified), at most a 1 / (REFERENCE_INTERVAL + 1) share of a load's steps.

With n-gram proposals the check above judges both sources together, and n-gram
continuations, which cost no drafting, can carry a drafter that does not pay for itself:
at 16 requests on code the hybrid's check vetoed 18% of the steps while the drafter ran on
39% of them for 4.8 ms a step, where the drafter alone was vetoed on 75% (serving
frontier, 2026-12-05). So, with `check_drafter_against_ngram`, `drafter_vetoes` compares
the hybrid as its model decides with n-gram proposals alone, at each load: two samples of
steps, both chosen by count, never by content. The hybrid's sample is every step the
check leaves to the model (the drafter run, or left out by the drafter skip,
hybrid.DrafterSkip). The reference is a step without the drafter: after
`REFERENCE_INTERVAL` steps of the hybrid, `drafter_reference_due` asks the controller for
two steps that do not draft; the first still verifies the drafts of the step before it and
the step after them drafts without verifying any (half the drafter's work each, counted in
neither sample), the second is the reference (`DrafterRole`). Once the hybrid's recent
gains lie below the references' by `CONFIDENCE` standard errors (of the difference), that
load stops drafting but goes on verifying n-gram continuations; every step is then a step
without the drafter by count, and the drafter comes back, as above, once the last
`LIFT_PROBES` probes' steps gained more than those by a standard error.

The first version took as its reference every step without the drafter, those the skip
left it out of included: the skip leaves the drafter out where copying is predicted to
serve more, so that sample was chosen by content and the drafter looked worse than it is
(closed loop, 2026-12-06: vetoes on 84-88% of the steps at one and four requests on code,
0.78x and 0.92x the default).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

# Weight of the older gains at each new speculative step of a bucket (about 100 recent
# steps decide) and of the older reference at each new plain step. With 20 steps (0.95)
# a load gaining 4% with gains spread as at four requests was vetoed within 400 steps in
# 9 runs of 20, with 100 in 2; one losing 6% is vetoed about as soon either way (median
# 33 and 41 steps; tests/test_realized_speed.py).
GAIN_FORGETTING = 0.99
REFERENCE_SMOOTHING = 0.1
# Speculative steps (effective count) and plain steps a bucket needs before it can veto,
# and the speculative steps of a probe that drafts (its drafting step and its verifying
# step; one that only verifies n-gram continuations has one, so the window then holds
# twice LIFT_PROBES of them).
MIN_SPECULATIVE_STEPS = 8.0
MIN_PLAIN_STEPS = 2
PROBE_STEPS = 2.0
# Speculative steps (effective count) of one request before its own gains can veto, and
# the standard errors they must lie below 1: every request is tested at every step, so
# with 16 and 2 (the load's own) 16 requests gaining 1.08x each were vetoed in 5 of 20
# simulated runs of 400 steps; with 32 and 3 in none, while one request at 0.75x among
# them is caught after a median 32 of its steps and one at 0.92x after 135
# (tests/test_realized_speed.py).
REQUEST_MIN_STEPS = 32.0
REQUEST_CONFIDENCE = 3.0
# Speculative steps at a load after which a request without a step there is forgotten
# (it finished or left the load).
REQUEST_MEMORY_STEPS = 64
# Standard errors the mean gain must lie below 1 to veto: per-step gains at one request
# range from a drafted step's cost alone to K + 1 tokens, and acceptance comes in runs,
# so a run of unlucky steps must not do it.
CONFIDENCE = 2.0
# Probes whose steps' mean gain lifts a veto, and the standard errors by which it must
# exceed 1.
LIFT_PROBES = 3
LIFT_CONFIDENCE = 1.0
# Speculative steps at a load after which, without a plain step among them, the next step is
# plain to refresh the reference (module docstring).
REFERENCE_INTERVAL = 32


def load_bucket(num_requests: int) -> int:
    """1 -> 0, 2-3 -> 1, 4-7 -> 2, ...: loads whose steps cost alike share a bucket."""
    return max(0, int(num_requests).bit_length() - 1)


class DrafterRole(enum.Enum):
    """What a step samples for the drafter's check (module docstring)."""

    AS_DECIDED = "as decided"  # the hybrid as its model decides
    REFERENCE = "reference"  # without the drafter by count: n-gram proposals alone
    BESIDE_REFERENCE = "beside a reference"  # half the drafter's work: in neither sample


@dataclass
class StepRecord:
    """One decode step, filled in as its parts become known."""

    requests: int  # requests in the pass
    profiled_plain_s: float  # the profile's step for a plain pass of `requests` tokens
    verified: bool  # drafts were verified in it
    seconds: float | None = None  # measured wall time, drafting included
    drafting_s: float = 0.0  # the drafter's own measured time in it
    drafted: bool = False  # the drafter ran in it (depth > 0), not only its context pass
    tokens: int | None = None  # tokens emitted by its requests
    # The drafting requests and the tokens each emitted (NaN: no output), for their own
    # gains; empty where the step had none.
    request_ids: tuple[str, ...] = ()
    request_tokens: np.ndarray | None = None
    # Some request verified the drafter's drafts, not only n-gram continuations (set where
    # the drafter is checked against them).
    verified_drafter: bool = False
    # The check itself kept the step plain (a veto or a reference step): no sample of
    # what the n-gram proposals alone realize.
    kept_plain: bool = False
    drafter_role: DrafterRole = DrafterRole.AS_DECIDED
    folded: bool = False


@dataclass
class _Gains:
    """Decayed sums over speculative steps: sum w, sum w^2, sum w g, sum w g^2."""

    weight: float = 0.0
    weight_sq: float = 0.0
    gain_sum: float = 0.0
    gain_sq_sum: float = 0.0
    last_step: int = 0  # the bucket's speculative step that last added a gain

    def add(self, gain: float, step: int = 0) -> None:
        self.weight = GAIN_FORGETTING * self.weight + 1.0
        self.weight_sq = GAIN_FORGETTING**2 * self.weight_sq + 1.0
        self.gain_sum = GAIN_FORGETTING * self.gain_sum + gain
        self.gain_sq_sum = GAIN_FORGETTING * self.gain_sq_sum + gain * gain
        self.last_step = step

    def mean_and_error(self) -> tuple[float, float, float]:
        """(mean gain, its standard error, effective number of steps)."""
        mean = self.gain_sum / self.weight
        variance = max(0.0, self.gain_sq_sum / self.weight - mean * mean)
        count = self.weight**2 / self.weight_sq
        return mean, float(np.sqrt(variance / count)), count


def _probe_window() -> deque:
    """The gains of the last LIFT_PROBES probes' steps (what lifts a veto)."""
    return deque(maxlen=int(LIFT_PROBES * PROBE_STEPS))


def _lifts(window: deque, bar: float) -> tuple[bool, float, float, int]:
    """(whether the probes' steps in a full `window` gained more than `bar` by
    LIFT_CONFIDENCE standard errors, their mean gain, its error, their count)."""
    if len(window) < window.maxlen:
        return False, np.nan, np.nan, len(window)
    gains = np.array(window)
    mean, error = gains.mean(), gains.std() / np.sqrt(len(gains))
    return mean - LIFT_CONFIDENCE * error >= bar, mean, error, len(gains)


@dataclass
class _DrafterVerdict:
    """Per load: the hybrid's steps as decided against steps without the drafter (module
    docstring)."""

    hybrid: _Gains = field(default_factory=_Gains)  # its steps as decided
    without: _Gains = field(default_factory=_Gains)
    recent: deque = field(default_factory=_probe_window)  # probes' steps under a veto
    vetoed: bool = False
    since_reference: int = 0  # the hybrid's steps since the last reference

    def add(self, gain: float, step: StepRecord) -> None:
        if step.kept_plain:
            return
        drafter_in_step = step.drafted or step.verified_drafter
        if self.vetoed:  # probes against the steps between them, left without it by the veto
            (self.recent.append if drafter_in_step else self.without.add)(gain)
        elif step.drafter_role is DrafterRole.REFERENCE and not drafter_in_step:
            self.without.add(gain)
            self.since_reference = 0
        elif step.drafter_role is DrafterRole.AS_DECIDED:
            self.hybrid.add(gain)
            self.since_reference += 1

    def judge(self) -> tuple[bool, float, float, float]:
        """(whether the verdict changes, the hybrid's gain (its probes' under a veto), its
        margin of error, the gain without the drafter)."""
        if self.without.weight == 0.0 or (self.hybrid.weight == 0.0 and not self.vetoed):
            return False, np.nan, np.nan, np.nan
        without, without_error, without_count = self.without.mean_and_error()
        if self.vetoed:  # the last probes' steps alone
            lifted, mean, error, _ = _lifts(self.recent, without)
            return lifted, mean, error, without
        mean, error, count = self.hybrid.mean_and_error()
        error = float(np.hypot(error, without_error))
        enough = min(count, without_count) >= MIN_SPECULATIVE_STEPS
        return enough and mean + CONFIDENCE * error < without, mean, error, without


@dataclass
class _Bucket:
    reference: float = 0.0  # measured / profiled time of plain steps
    plain_steps: int = 0
    speculative_since_plain: int = 0
    vetoed: bool = False
    speculative_steps: int = 0
    gains: _Gains = field(default_factory=_Gains)  # per step, tokens per request
    drafter: _DrafterVerdict = field(default_factory=_DrafterVerdict)  # hybrid: the drafter's own worth
    requests: dict[str, _Gains] = field(default_factory=dict)  # per request, its own tokens
    recent: deque = field(default_factory=_probe_window)

    def clear_gains(self) -> None:
        self.gains, self.requests = _Gains(), {}
        self.recent.clear()

    def slowest_request(self) -> tuple[str, float, float, float] | None:
        """The request whose recent gains lie lowest (mean + REQUEST_CONFIDENCE standard
        errors) among those with REQUEST_MIN_STEPS: (id, mean, error, steps)."""
        judged = [(rid, *g.mean_and_error()) for rid, g in self.requests.items()]
        judged = [j for j in judged if j[3] >= REQUEST_MIN_STEPS]
        return min(judged, key=lambda j: j[1] + REQUEST_CONFIDENCE * j[2], default=None)


class RealizedSpeed:
    """Per-load realized gains of speculative steps over plain ones (module docstring)."""

    def __init__(self, each_request: bool = True, drafter_against_ngram: bool = False) -> None:
        """`each_request`: a request whose own gains lie below 1 vetoes its load too;
        `drafter_against_ngram`: keep the drafter's verdict (`drafter_vetoes`) too."""
        self._buckets: dict[int, _Bucket] = {}
        self.each_request = each_request
        self.drafter_against_ngram = drafter_against_ngram

    def add(self, step: StepRecord) -> None:
        """Fold a step once its time and tokens are both known (idempotent)."""
        if step.folded or step.seconds is None or step.tokens is None or step.seconds <= 0.0 or step.requests <= 0:
            return
        step.folded = True
        bucket = self._buckets.setdefault(load_bucket(step.requests), _Bucket())
        plain_s = step.seconds - step.drafting_s
        if not step.verified and plain_s > 0.0:
            weight = 1.0 if bucket.plain_steps == 0 else REFERENCE_SMOOTHING
            bucket.reference += weight * (plain_s / step.profiled_plain_s - bucket.reference)
            bucket.plain_steps += 1
            bucket.speculative_since_plain = 0
        elif step.verified:
            bucket.speculative_since_plain += 1
        if bucket.plain_steps == 0:
            return  # nothing to compare with yet
        token_gain = bucket.reference * step.profiled_plain_s / step.seconds  # one token's worth
        gain = (step.tokens / step.requests) * token_gain
        if self.drafter_against_ngram:
            bucket.drafter.add(gain, step)
        if not (step.verified or step.drafted):
            return
        bucket.speculative_steps += 1
        bucket.gains.add(gain, bucket.speculative_steps)
        bucket.recent.append(gain)
        if self.each_request and step.request_tokens is not None:  # else nothing reads them
            for request_id, tokens in zip(step.request_ids, step.request_tokens):
                if np.isfinite(tokens):
                    bucket.requests.setdefault(request_id, _Gains()).add(tokens * token_gain,
                                                                         bucket.speculative_steps)
        if len(bucket.requests) > step.requests:  # forget requests gone from this load
            horizon = bucket.speculative_steps - REQUEST_MEMORY_STEPS
            bucket.requests = {r: g for r, g in bucket.requests.items() if g.last_step > horizon}

    def gain(self, num_requests: int) -> tuple[float, float, float] | None:
        """(mean recent gain, standard error, effective steps) at this load; None while
        there is nothing to compare."""
        bucket = self._buckets.get(load_bucket(num_requests))
        if bucket is None or bucket.plain_steps < MIN_PLAIN_STEPS or bucket.gains.weight == 0.0:
            return None
        return bucket.gains.mean_and_error()

    def reference_due(self, num_requests: int) -> bool:
        """True (once) where the last REFERENCE_INTERVAL speculative steps at this load had
        no plain step beside them: the caller makes the next step verify nothing. The
        count starts again now, since that step is folded only a step later."""
        bucket = self._buckets.get(load_bucket(num_requests))
        if bucket is None or bucket.speculative_since_plain < REFERENCE_INTERVAL:
            return False
        bucket.speculative_since_plain = 0
        return True

    def vetoes(self, num_requests: int) -> bool:
        """The verdict at this load, updated from the gains since it last changed: True
        where speculating has measurably realized less than plain decoding. Each change
        is logged with the gains that made it."""
        index = load_bucket(num_requests)
        bucket = self._buckets.get(index)
        measured = self.gain(num_requests)
        if bucket is None or measured is None:
            return bucket is not None and bucket.vetoed
        mean, error, count = measured
        who = "recent speculative steps"
        if bucket.vetoed:  # the last probes' steps alone (never empty here: weight > 0)
            changed, mean, error, count = _lifts(bucket.recent, 1.0)
        else:
            changed = count >= MIN_SPECULATIVE_STEPS and mean + CONFIDENCE * error < 1.0
            slowest = bucket.slowest_request() if self.each_request else None
            if not changed and slowest is not None and slowest[1] + REQUEST_CONFIDENCE * slowest[2] < 1.0:
                who = f"request {slowest[0]}'s recent speculative steps"
                mean, error, count = slowest[1:]
                changed = True
        if changed:
            bucket.vetoed = not bucket.vetoed
            logger.info(
                "vllm_dspark: at %d-%d requests %s realized %.2fx (+- %.2f, %.0f steps) the per-request speed of "
                "plain ones: %s", 2**index, 2 ** (index + 1) - 1, who, mean, error, count,
                "plain decoding, probing now and then" if bucket.vetoed else "speculating as the model decides",
            )
            bucket.clear_gains()
        return bucket.vetoed

    def drafter_reference_due(self, num_requests: int) -> bool:
        """True (once) where the last REFERENCE_INTERVAL steps of the hybrid at this load
        had no reference among them: the caller leaves the drafter out of the next two
        steps (module docstring). Never where the load is kept plain (those steps would
        verify n-gram rows)."""
        bucket = self._buckets.get(load_bucket(num_requests))
        if bucket is None or bucket.vetoed or bucket.drafter.since_reference < REFERENCE_INTERVAL:
            return False
        bucket.drafter.since_reference = 0
        return True

    def drafter_vetoes(self, num_requests: int) -> bool:
        """The drafter's verdict at this load (hybrid): True where the hybrid's steps have
        measurably realized less than its reference steps without the drafter (module
        docstring). Each change is logged."""
        index = load_bucket(num_requests)
        bucket = self._buckets.get(index)
        if bucket is None:
            return False
        verdict = bucket.drafter
        changed, mean, error, without = verdict.judge()
        if changed:
            verdict.vetoed = not verdict.vetoed
            logger.info(
                "vllm_dspark: at %d-%d requests the hybrid's steps realized %.2fx (+- %.2f) the per-request "
                "speed of plain ones, its steps without the drafter %.2fx: %s", 2**index, 2 ** (index + 1) - 1,
                mean, error, without,
                "n-gram proposals alone, probing the drafter now and then" if verdict.vetoed
                else "drafting as the model decides",
            )
            verdict.hybrid = _Gains()
            verdict.recent.clear()
        return verdict.vetoed
