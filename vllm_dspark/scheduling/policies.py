"""Verification-length policies: how many draft tokens of each request the target verifies.

A policy is an object built once with its typed options; `lengths(step)` maps one step's
calibrated confidences to per-request lengths. The engine's controller, the simulator and
the tests build the same classes (`policy_from_options` from the validated serving
options, `build_policy` from a name and keyword options), so every consumer runs the same
decision code. All policies are vectorised NumPy over the [R, K] confidence array; none
loops over candidates in Python.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, get_args

import numpy as np

from vllm_dspark.scheduling import ranking
from vllm_dspark.scheduling.ranking import SpsFunction
from vllm_dspark.scheduling.sla import plan_sla

if TYPE_CHECKING:
    from vllm_dspark.config import PluginOptions

PolicyName = Literal["fixed", "threshold", "dspark", "dspark_async", "sla"]
POLICIES: tuple[str, ...] = get_args(PolicyName)
# What the dspark policy maximises per step (DSparkPolicy): expected tokens per second of
# the engine, or the product of the requests' expected speeds.
Objective = Literal["throughput", "per_user"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
# Top-`budget` admission over the candidate order: NumPy here, a GPU kernel in the engine.
Admission = Callable[[np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class PolicyStep:
    """What a policy sees of one step."""

    confidences: np.ndarray  # [R, K] checked conditional confidences, 0 where no draft
    sps: SpsFunction
    base_tokens: int = 0  # other tokens of the same pass: prefill chunks, `plain_requests`
    min_tokens_per_s: np.ndarray | None = None  # [R] per-request floors (sla), None = default
    # Decoding requests of the same pass with nothing to verify (no proposal this step):
    # each emits a token and is slowed by every verified draft, like the R requests here.
    plain_requests: int = 0


class VerifyPolicy(ABC):
    """Maps a step's confidences to verification lengths, int64 [R] in 0..K."""

    name: ClassVar[PolicyName]
    serving_options: ClassVar[tuple[str, ...]] = ()  # PluginOptions fields the policy takes
    needs_curve: ClassVar[bool] = False  # prices drafts with the engine's SPS curve
    uses_request_floors: ClassVar[bool] = False  # reads PolicyStep.min_tokens_per_s
    # Whether the controller may choose how deep to draft (0 = not at all) by expected
    # throughput; a policy that verifies a fixed amount drafts exactly that much.
    adaptive_depth: ClassVar[bool] = False

    @abstractmethod
    def lengths(self, step: PolicyStep) -> np.ndarray: ...

    @classmethod
    def from_options(cls, options: PluginOptions, admission: Admission) -> VerifyPolicy:
        """The policy as served with these validated plugin options."""
        return cls(**{field: getattr(options, field) for field in cls.serving_options})

    def max_draft_depth(self, block: int) -> int:
        """The most draft positions this policy can verify per request."""
        return block

    def min_survival(self, sps: SpsFunction, num_requests: int, block: int) -> float:
        """A prefix survival below which this policy never verifies a slot, at this load:
        the drafter may stop drafting a request there (0: draft every position)."""
        return 0.0


class FixedPolicy(VerifyPolicy):
    """Verify the same k tokens of every request (k defaults to K, larger k is clipped to K)."""

    name = "fixed"
    serving_options = ("k",)

    def __init__(self, k: int | None = None) -> None:
        if k is not None and k < 0:
            raise ValueError(f"fixed policy needs k >= 0, got {k}")
        self.k = k

    def max_draft_depth(self, block: int) -> int:
        return block if self.k is None else min(int(self.k), block)

    def lengths(self, step: PolicyStep) -> np.ndarray:
        num_requests, block = step.confidences.shape
        return np.full(num_requests, self.max_draft_depth(block), dtype=np.int64)


class ThresholdPolicy(VerifyPolicy):
    """Verify the longest prefix whose survival a_k is at least `threshold` (load-blind)."""

    name = "threshold"
    serving_options = ("threshold",)

    def __init__(self, threshold: float = 0.5) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
        self.threshold = threshold

    def min_survival(self, sps: SpsFunction, num_requests: int, block: int) -> float:
        return self.threshold

    def lengths(self, step: PolicyStep) -> np.ndarray:
        survival = np.cumprod(step.confidences, axis=1)
        return np.count_nonzero(survival >= self.threshold, axis=1).astype(np.int64)


# Share of the admission bound kept as the drafting early stop: the next step's load may
# differ from this one's, and stopping too early only costs accepted tokens.
EARLY_STOP_MARGIN = 0.5


def never_verified_below(sps: SpsFunction, num_requests: int, block: int, per_user: bool = False) -> float:
    """The drafting early stop of the policies that verify a candidate only if it raises
    expected throughput (dspark, sla). The dspark scan admits candidate n only if
    a_n > tau(n-1) * (SPS(B-1) / SPS(B+m) - 1) / (m+1) for some m >= 0 (m = 0: the plain
    early stop; sla only ever uses m = 0), and tau >= R (every request's own token). That
    average relative step-cost increase is at least the smallest one-token increase, so
    below R times the smallest over the pass sizes the step can reach no slot is ever
    verified; `EARLY_STOP_MARGIN` of that bound is returned. `per_user` (dspark's per-user
    objective): a slot is admitted only if its gain u_n > R log(SPS(B-1) / SPS(B)), and
    a_n >= u_n, so the bound takes the log of one plus the increase instead."""
    if num_requests == 0 or block == 0:
        return 0.0
    batch = np.arange(num_requests, num_requests * (block + 1) + 1, dtype=np.float64)
    steps = np.asarray(sps(batch), dtype=np.float64)
    increase = max(0.0, float((steps[:-1] / steps[1:] - 1.0).min()))
    return EARLY_STOP_MARGIN * num_requests * (np.log1p(increase) if per_user else increase)


class DSparkPolicy(VerifyPolicy):
    """DSPARK.md section 4: scan candidates by survival, stop at the first that does not
    strictly raise expected throughput tau * SPS(B), unless the candidates expected after it
    (the previous call's ranked survivals, capped by its own) could still make verifying
    more pay: a cliff of a jagged SPS curve (`ranking.cliff_aware_stop`). Neither stop reads
    a later candidate of this step, so both are lossless; a first call (no history) is the
    plain early stop.

    `objective="per_user"` maximises the sum over requests of log expected speed,
    sum_r log(1 + A_r) + R log SPS(B), instead of tau * SPS(B): the product of the
    requests' speeds, so a slot counts by how much it speeds up its own request, and a
    pass lengthened for one request is charged to every request it slows (throughput
    verifies a confident slot of one request whenever the tokens gained outweigh the
    longer pass). At one request the two agree. Measured on a CPU (SmolLM2, R = 1 to 16)
    it gained nothing beyond the spread between waves, so it is an option, not the default
    (benchmarks/results/per_user_objective/). It scans `ranking.rank_by_user_gain`'s
    order, lossless by the same argument. Its look-ahead matters beyond cliffs: the log
    of an affine step time is concave, so the first of many equally confident slots can
    cost every request more than it gains while all of them together pay; the previous
    call's ranked gains say whether they come."""

    name = "dspark"
    serving_options = ("objective",)
    needs_curve = True
    adaptive_depth = True

    def __init__(self, objective: Objective = "throughput") -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"dspark objective must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective
        self._previous: tuple[np.ndarray, int] | None = None  # last call's ranked values, R

    def min_survival(self, sps: SpsFunction, num_requests: int, block: int) -> float:
        return never_verified_below(sps, num_requests, block, per_user=self.objective == "per_user")

    def lengths(self, step: PolicyStep) -> np.ndarray:
        num_requests, block = step.confidences.shape
        if self.objective == "per_user":
            order, values = ranking.rank_by_user_gain(step.confidences)
            totals = np.r_[0.0, np.cumsum(values)]
            steps = ranking.pass_sps(step.sps, step.base_tokens + num_requests, len(values) + 1)
            slowed = num_requests + step.plain_requests

            def combine(gains: np.ndarray, sps: np.ndarray) -> np.ndarray:
                return gains + slowed * np.log(np.maximum(sps, 1e-300))
        else:
            order = ranking.rank_candidates(step.confidences)
            values = order.survival
            totals, steps = ranking.expected_throughput(order, step.sps, step.base_tokens, step.plain_requests)

            def combine(tau: np.ndarray, sps: np.ndarray) -> np.ndarray:
                return tau * sps
        previous, slots = self._previous, num_requests * block

        def lookahead() -> tuple[np.ndarray, np.ndarray]:
            assert previous is not None
            reach = ranking.pass_sps(step.sps, step.base_tokens + num_requests, slots + 1)
            return reach, ranking.tail_from(*previous, num_requests, slots)

        objective = combine(totals, steps)
        count = ranking.cliff_aware_stop(values, totals, objective, combine,
                                         None if previous is None else lookahead)
        self._previous = (values, num_requests)
        return ranking.lengths_of_prefix(order, count)


def dspark_budget(old_confidences: np.ndarray, sps: SpsFunction, base_tokens: int = 0, plain_requests: int = 0) -> int:
    """Total draft slots to verify, for `dspark_async`, from confidences of an earlier step.

    A full scan without early stop: the argmax of tau * SPS(B) over every prefix of the
    candidate order (smallest on ties), so it can pass the step-like cliffs of a real SPS
    curve. Looking ahead is safe only because the budget is applied to *later* confidences,
    which it cannot depend on; applied to the confidences it was computed from, it is the
    biased look-back search of DSPARK.md's counter-example.
    """
    c = ranking.check_confidences(old_confidences)
    if c.size == 0:
        return 0
    tau, steps = ranking.expected_throughput(ranking.rank_candidates(c), sps, base_tokens, plain_requests)
    return int(np.argmax(tau * steps))


def admit_top_budget(confidences: np.ndarray, budget: int) -> np.ndarray:
    """Verify the `budget` best slots in the candidate order (fewer if fewer have a > 0)."""
    return ranking.lengths_of_prefix(ranking.rank_candidates(confidences), int(budget))


class DSparkAsyncPolicy(VerifyPolicy):
    """Verify a budget of slots planned from the previous step's confidences (DSPARK.md
    section 4, production variant).

    With `budget` given, every call admits that many slots (the stateless form). Without
    it the policy plans its own chain: each call admits the budget planned by the call
    before (`dspark_budget` of that call's confidences) and plans the next one; the very
    first call has no earlier confidences and runs the early-stopping `dspark` scan.
    """

    name = "dspark_async"
    needs_curve = True
    adaptive_depth = True

    def __init__(self, budget: int | None = None, admission: Admission = admit_top_budget) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"dspark_async needs budget >= 0, got {budget}")
        self.budget = budget
        self.chained = budget is None
        self.admission = admission

    @classmethod
    def from_options(cls, options: PluginOptions, admission: Admission) -> VerifyPolicy:
        return cls(admission=admission)

    def lengths(self, step: PolicyStep) -> np.ndarray:
        if self.budget is None:
            lengths = DSparkPolicy().lengths(step)
        else:
            lengths = self.admission(step.confidences, self.budget)
        if self.chained:
            self.budget = dspark_budget(step.confidences, step.sps, step.base_tokens, step.plain_requests)
        return lengths


class SlaPolicy(VerifyPolicy):
    """Throughput under per-user tokens/s floors (see `sla`): each request's own floor
    when the step carries one, else `min_tokens_per_s`."""

    name = "sla"
    serving_options = ("min_tokens_per_s",)
    needs_curve = True
    uses_request_floors = True
    # It takes only candidates that raise expected throughput (`sla`), so the depth that
    # maximises expected throughput and dspark's early stop bound what it can verify.
    adaptive_depth = True

    def __init__(self, min_tokens_per_s: float | np.ndarray | None = None) -> None:
        self.min_tokens_per_s = min_tokens_per_s

    def lengths(self, step: PolicyStep) -> np.ndarray:
        floors = self.min_tokens_per_s if step.min_tokens_per_s is None else step.min_tokens_per_s
        if floors is None:
            raise ValueError("sla policy needs min_tokens_per_s (a float or an array [R])")
        return plan_sla(step.confidences, step.sps, floors, base_tokens=step.base_tokens,
                        plain_requests=step.plain_requests).lengths

    def min_survival(self, sps: SpsFunction, num_requests: int, block: int) -> float:
        return never_verified_below(sps, num_requests, block)


POLICY_TYPES: dict[str, type[VerifyPolicy]] = {
    cls.name: cls for cls in (FixedPolicy, ThresholdPolicy, DSparkPolicy, DSparkAsyncPolicy, SlaPolicy)
}
assert tuple(POLICY_TYPES) == POLICIES, "one class per policy name, in the Literal's order"


def build_policy(policy: str, **options: object) -> VerifyPolicy:
    """A policy from its name and keyword options (clear errors for unknown ones)."""
    if policy not in POLICY_TYPES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    cls = POLICY_TYPES[policy]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "admission")]
    unknown = options.keys() - set(accepted)
    if unknown:
        raise ValueError(f"policy {policy!r} takes options {sorted(accepted)}, got {sorted(unknown)}")
    if policy == "dspark_async" and "budget" not in options:
        raise ValueError("dspark_async needs budget=dspark_budget(<confidences of an earlier step>, sps)")
    return cls(**options)


def policy_from_options(options: PluginOptions, admission: Admission = admit_top_budget) -> VerifyPolicy:
    """The serving policy of validated plugin options (dspark_async plans its own chain)."""
    return POLICY_TYPES[options.policy].from_options(options, admission)


def select_verify_lengths(
    confidences: np.ndarray,
    sps: SpsFunction,
    policy: str = "dspark",
    *,
    base_tokens: int = 0,
    plain_requests: int = 0,
    **options: object,
) -> np.ndarray:
    """One decision of a freshly built policy: int64 [R] lengths in 0..K.

    `confidences` are conditional confidences c[r, k] in [0, 1] (NaN or out-of-range values
    raise ValueError). `sps` maps batch token counts to engine steps per second, e.g. an
    `SpsCurve`. A pass carries `base_tokens` (prefill tokens of other requests) plus one
    token per decoding request plus the verified drafts; `plain_requests` of the
    base_tokens are decoding requests with no drafts (each emits a token). The prefill
    tokens place the pass on the curve, but their own time is not charged to the drafts
    (`ranking.decoding_part`). Options per policy:
    fixed: k; threshold: threshold; dspark: none; dspark_async: budget; sla:
    min_tokens_per_s.
    """
    chosen = build_policy(policy, **options)
    return decide_lengths(chosen, PolicyStep(np.asarray(confidences), sps, base_tokens, plain_requests=plain_requests))


def decide_lengths(policy: VerifyPolicy, step: PolicyStep) -> np.ndarray:
    """Validate the step's inputs, then ask the policy (empty blocks verify nothing) about
    the pass's decoding part: prompt tokens among the other tokens are priced apart
    (`ranking.decoding_part`), the policy sees only the decoding requests without drafts."""
    if step.base_tokens < 0 or not 0 <= step.plain_requests <= step.base_tokens:
        raise ValueError("need 0 <= plain_requests <= base_tokens (a plain request's token is one of the "
                         f"pass's other tokens), got base_tokens={step.base_tokens}, "
                         f"plain_requests={step.plain_requests}")
    c = ranking.check_confidences(step.confidences)
    if c.size == 0:
        return np.zeros(c.shape[0], dtype=np.int64)
    prompt_tokens = step.base_tokens - step.plain_requests
    sps = ranking.decoding_part(step.sps, prompt_tokens, c.shape[0] + step.plain_requests)
    return policy.lengths(dataclasses.replace(step, confidences=c, sps=sps, base_tokens=step.plain_requests))
