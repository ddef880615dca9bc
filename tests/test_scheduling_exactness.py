"""Losslessness of the verification schedulers.

1. DSPARK.md section 4's counter-example by Monte Carlo: one request, gamma 2, vocabulary
   {A, B}, target (0.7, 0.3), draft (0.5, 0.5), c_1 = 0.8, c_2 = 0.9 after A and 0 after B,
   SPS(1..3) = 1, 0.5, 0.45. The scheduler runs after drafting, so it sees c_1 and c_2(x_1).
   Standard rejection sampling of the verified prefix then gives the first output token.
   The early-stopping `dspark` policy keeps the target distribution; a look-back search
   (full scan, argmax over all prefixes: `dspark_async` with a budget computed from the
   same confidences) skews it to about (0.85, 0.15).
2. The property behind it, on random inputs: whether draft token j of request r is verified
   must not change when c[r, j+1..K] (which read token j) change.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.scheduling import SpsCurve, dspark_budget, select_verify_lengths
from vllm_dspark.scheduling.policies import DSparkPolicy, PolicyStep

TARGET = np.array([0.7, 0.3])
DRAFT = np.array([0.5, 0.5])
CURVE = SpsCurve(points=[(1, 1.0), (2, 0.5), (3, 0.45)])
TRIALS = 20_000
CHI2_1DOF_P001 = 10.828  # chi-square critical value, 1 degree of freedom, p = 0.001


def confidences_after(x1: int) -> np.ndarray:
    """c_1 = 0.8 (= sum min(p_t, p_d), the true acceptance rate); c_2 reads x_1."""
    return np.array([[0.8, 0.9 if x1 == 0 else 0.0]])


def look_back_lengths(c: np.ndarray) -> np.ndarray:
    """The biased search: pick the best prefix after seeing all of the current confidences."""
    return select_verify_lengths(c, CURVE, "dspark_async", budget=dspark_budget(c, CURVE))


def first_token(rng: np.random.Generator, x1: int, verified: int) -> int:
    """First output token of a round under standard rejection sampling."""
    if verified == 0:
        return int(rng.random() < TARGET[1])  # bonus token straight from the target
    if rng.random() < min(1.0, TARGET[x1] / DRAFT[x1]):
        return x1
    residual = np.maximum(TARGET - DRAFT, 0.0)
    return int(rng.random() < residual[1] / residual.sum())


def first_token_counts(schedule, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(2, dtype=np.int64)
    for _ in range(TRIALS):
        x1 = int(rng.random() < DRAFT[1])
        verified = int(schedule(confidences_after(x1))[0])
        counts[first_token(rng, x1, verified)] += 1
    return counts


def chi_square(counts: np.ndarray, probabilities: np.ndarray) -> float:
    expected = counts.sum() * probabilities
    return float(((counts - expected) ** 2 / expected).sum())


def dspark_after(history: list[list[float]], objective: str = "throughput"):
    """dspark as the engine runs it: one policy object that has seen an earlier step."""
    def schedule(c: np.ndarray, curve: SpsCurve = CURVE) -> np.ndarray:
        policy = DSparkPolicy(objective)  # type: ignore[arg-type]
        policy.lengths(PolicyStep(np.asarray(history, dtype=np.float64), curve))
        return policy.lengths(PolicyStep(np.asarray(c, dtype=np.float64), curve))
    return schedule


SCHEDULES = {
    "dspark": lambda c: select_verify_lengths(c, CURVE, "dspark"),
    # With a history predicting a strong tail the scan steps over SPS(2)'s cliff: it
    # verifies x_1 after A and after B alike, and x_2 only after A (c_2 reads x_1).
    "dspark_past_the_cliff": dspark_after([[0.8, 0.9]]),
    "dspark_per_user": lambda c: DSparkPolicy("per_user").lengths(PolicyStep(np.asarray(c, dtype=np.float64), CURVE)),
    "dspark_per_user_past_the_cliff": dspark_after([[0.8, 0.9]], "per_user"),
    # A budget from an earlier step does not depend on x_1: exact even without early stop.
    "async_old_budget": lambda c: select_verify_lengths(
        c, CURVE, "dspark_async", budget=dspark_budget([[0.8, 0.9]], CURVE)
    ),
    "sla": lambda c: select_verify_lengths(c, CURVE, "sla", min_tokens_per_s=0.95),
}


def test_the_history_makes_dspark_step_over_the_counter_example_s_cliff() -> None:
    assert select_verify_lengths(confidences_after(0), CURVE, "dspark").tolist() == [0]
    assert SCHEDULES["dspark_past_the_cliff"](confidences_after(0)).tolist() == [2]
    assert SCHEDULES["dspark_past_the_cliff"](confidences_after(1)).tolist() == [1]


@pytest.mark.parametrize("name", SCHEDULES)
def test_lossless_schedules_keep_the_target_distribution(name: str) -> None:
    counts = first_token_counts(SCHEDULES[name], seed=1)
    assert chi_square(counts, TARGET) < CHI2_1DOF_P001, counts


def test_look_back_search_is_biased_as_dspark_md_predicts() -> None:
    assert look_back_lengths(confidences_after(0)).tolist() == [2]
    assert look_back_lengths(confidences_after(1)).tolist() == [0]
    counts = first_token_counts(look_back_lengths, seed=2)
    assert chi_square(counts, TARGET) > CHI2_1DOF_P001, counts
    assert chi_square(counts, np.array([0.85, 0.15])) < CHI2_1DOF_P001, counts


def random_curve(rng: np.random.Generator) -> SpsCurve:
    """Jagged: step times with cliffs and dips, so early stops happen in odd places."""
    sizes = np.cumsum(rng.integers(1, 4, size=8))
    return SpsCurve(points=list(zip(sizes.tolist(), rng.uniform(0.3, 1.0, size=8).tolist())))


LOSSLESS = {
    "fixed": {"k": 2},
    "threshold": {"threshold": 0.4},
    "dspark": {},
    "dspark, per-user objective": {"objective": "per_user"},
    "dspark_async": {"budget": 5},
    "sla": {"min_tokens_per_s": 0.9},
}


def verified_flags(c: np.ndarray, curve: SpsCurve, schedule) -> np.ndarray:
    """flags[r, j - 1] = whether draft token j of request r is verified."""
    lengths = schedule(c, curve)
    return lengths[:, None] >= np.arange(1, c.shape[1] + 1)[None, :]


def anticipation_violations(schedule, seeds: range) -> int:
    """Count (case, r, j) where resampling c[r, j+1..] changes whether token j is verified."""
    violations = 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        c = rng.uniform(0.0, 1.0, size=(3, 4)) ** 0.5
        curve = random_curve(rng)
        flags = verified_flags(c, curve, schedule)
        for r in range(c.shape[0]):
            for j in range(1, c.shape[1]):
                changed = c.copy()
                changed[r, j:] = rng.uniform(0.0, 1.0, size=c.shape[1] - j)
                violations += flags[r, j - 1] != verified_flags(changed, curve, schedule)[r, j - 1]
    return violations


@pytest.mark.parametrize("policy", LOSSLESS)
def test_policies_do_not_anticipate(policy: str) -> None:
    def schedule(c: np.ndarray, curve: SpsCurve) -> np.ndarray:
        return select_verify_lengths(c, curve, policy.split(",")[0], **LOSSLESS[policy])

    assert anticipation_violations(schedule, range(150)) == 0


@pytest.mark.parametrize("objective", ["throughput", "per_user"])
def test_dspark_with_history_does_not_anticipate(objective: str) -> None:
    history = np.random.default_rng(7).uniform(0.5, 1.0, size=(3, 4))
    schedule = dspark_after(history.tolist(), objective)
    assert anticipation_violations(schedule, range(150)) == 0


def test_the_property_check_catches_a_look_back_search() -> None:
    def look_back(c: np.ndarray, curve: SpsCurve) -> np.ndarray:
        return select_verify_lengths(c, curve, "dspark_async", budget=dspark_budget(c, curve))

    assert anticipation_violations(look_back, range(150)) > 0
