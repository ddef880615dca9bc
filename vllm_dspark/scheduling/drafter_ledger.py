"""Whether a request admitted now gets the drafter: its measured value per load.

The drafter costs every request it serves something on every step, drafting or not: the
context pass stores K/V for each of the request's tokens (its prompt included), so that a
later draft can see them. Which step drafts is decided step by step (controller.py), but the
context has to be there before the first draft, so whether a request has the drafter at
all is decided once, when it is admitted. A request admitted without it keeps its n-gram
continuations (hybrid.py), is left out of the context pass, and never verifies a drafter
block.

The decision weighs what the drafter realized at the load the request joins, in seconds of
the engine's steps, over recent steps at that load (`load_bucket`, discounted per step):
- gained: each accepted drafter draft is a token the request did not wait a step for,
  worth a plain pass's seconds per request, pass(R) / R;
- spent: the proposer's measured seconds (context pass and drafter forward passes), and
  the pass time its verified drafts added, pass(n) - pass(n - v) by the step-time model.
Requests admitted while gained < spent get no drafter. Costs that grow with the requests
in the pass are charged as if every request had the drafter (seconds x R / E with E
requests having it), so that a few requests admitted with it do not look dearer than a
load where all have it.

Why it was built: at 16 requests on code on a 2-core CPU an engine that never drafts and
never writes the drafter's context served the median request 1.014x (1.002-1.024 with
requests resampled, 0.981-1.063 with turns) faster than the default (benchmarks/results/
closed_loop/`code_r16_no_drafter_cost.md`). What it gave there (`code_drafter_admission.md`,
`chat_drafter_admission.md`): 338 of 384 code requests turned away at 16, the drafter's time
3.9 -> 0.4 ms a step, but 1.003x (code) and 1.000x (chat) per request end to end, within
the spread of two identical engines; hence off by default (`PluginOptions.drafter_admission`).

Until a load has seen `MIN_EVIDENCE` discounted steps with the drafter (drafting or not:
the context is paid on every one, and where the controller seldom drafts, that is the
drafter as it serves there) it admits with the drafter. Evidence fades while no request
there has the drafter; once it falls below `MIN_EVIDENCE` the account starts afresh, so a
load where the drafter lost is tried again some hundreds of steps later (traffic changes),
every request admitted with it until the new account holds `MIN_EVIDENCE` steps: a trial
by enough requests that the controller drafts for them as it would for all.

Exactness: the decision reads earlier steps only, before any of the request's tokens are
drafted; it only removes proposals, and verification is lossless whatever is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dspark.scheduling.realized import load_bucket

# Per step at a load: 0.999 halves old evidence in about 700 steps there (at 16 requests
# on a 2-core CPU, about five closed-loop turns of 48 requests).
FORGETTING = 0.999
# Discounted steps with the drafter a load needs before its balance may turn a request
# away: long enough for the first requests admitted to draft after their prompt's context
# was paid for (at 16 requests on a CPU about 60 steps make a request's life).
MIN_EVIDENCE = 64.0


@dataclass
class DrafterBalance:
    """One load's discounted account of the drafter."""

    gained_s: float = 0.0
    spent_s: float = 0.0
    steps: float = 0.0  # with the drafter

    def age(self, spent_s: float | None) -> None:
        """One step at this load: old values fade; `spent_s` is the step's cost where some
        request had the drafter (None: none had it). Evidence that fades below
        `MIN_EVIDENCE` starts a new account (a new trial)."""
        judged = self.steps >= MIN_EVIDENCE
        self.gained_s *= FORGETTING
        self.spent_s *= FORGETTING
        self.steps *= FORGETTING
        if spent_s is not None:
            self.spent_s += spent_s
            self.steps += 1.0
        if judged and self.steps < MIN_EVIDENCE:
            self.gained_s = self.spent_s = self.steps = 0.0

    @property
    def pays(self) -> bool:
        return self.steps < MIN_EVIDENCE or self.gained_s >= self.spent_s


class DrafterLedger:
    """The drafter's balance per load bucket, fed by the controller step by step."""

    def __init__(self) -> None:
        self.balances: dict[int, DrafterBalance] = {}

    def balance(self, num_requests: int) -> DrafterBalance:
        bucket = load_bucket(num_requests)
        found = self.balances.get(bucket)  # called every step: no throwaway default
        if found is None:
            found = self.balances[bucket] = DrafterBalance()
        return found

    def admits(self, num_requests: int) -> bool:
        """Whether a request joining `num_requests` requests gets the drafter, judged on
        passes of that many requests."""
        return self.balance(num_requests).pays

    def observe_proposal(self, num_requests: int, with_drafter: int, seconds: float) -> None:
        """One proposal of a pass of `num_requests` requests, `with_drafter` of them having
        the drafter: its measured `seconds` (context pass and any drafting). Every step
        proposes, so this is where a load's account ages, with or without the drafter."""
        if num_requests > 0:
            self.balance(num_requests).age(seconds * num_requests / with_drafter if with_drafter > 0 else None)

    def observe_outcome(self, num_requests: int, with_drafter: int, accepted: int, added_pass_s: float,
                        token_value_s: float) -> None:
        """A verified step's outcome for the drafter's blocks: `accepted` drafts, each worth
        `token_value_s`, for `added_pass_s` of pass time their verification added."""
        if num_requests <= 0 or with_drafter <= 0:
            return
        balance = self.balance(num_requests)
        scale = num_requests / with_drafter
        balance.gained_s += accepted * token_value_s * scale
        balance.spent_s += added_pass_s * scale
