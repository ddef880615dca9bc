"""The `sla` policy: floors met, floors unmet, per-request floors, and a loop reference of
the documented stopping rule."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.scheduling import SpsCurve, plan_sla, select_verify_lengths

# Two requests, one draft slot each: a = 0.9 and 0.1. dspark verifies the first only:
# theta = 2 * 1.0 -> 2.9 * 0.9 = 2.61 -> 3.0 * 0.8 = 2.4 (stop).
TWO = SpsCurve(points=[(2, 1.0), (3, 0.9), (4, 0.8)])
C_TWO = np.array([[0.9], [0.1]])


def reference_sla(c: np.ndarray, sps, floors: np.ndarray, base_tokens: int = 0, plain_requests: int = 0) -> np.ndarray:
    """The stopping rule of `vllm_dspark.scheduling.sla`, one candidate at a time."""
    num_requests = c.shape[0]
    a = np.cumprod(c, axis=1)
    # Priority: requests predicted below their floor with one draft rank earlier.
    with np.errstate(divide="ignore", invalid="ignore"):
        first_speed = (1.0 + c[:, 0]) * float(sps(base_tokens + num_requests + 1))
        weight = np.maximum(1.0, np.nan_to_num(floors / first_speed, posinf=1e6))
    weight = weight / weight.max()
    slots = [(r, j + 1, a[r, j]) for r in range(num_requests) for j in range(c.shape[1])]
    order = sorted((s for s in slots if s[2] > 0), key=lambda s: (-s[2] * weight[s[0]], s[1], s[0]))
    per_step = np.ones(num_requests)
    lengths = np.zeros(num_requests, dtype=np.int64)

    def evaluate(n: int) -> tuple[float, float]:
        steps = float(sps(base_tokens + num_requests + n))
        # requests not reached yet count as if their first draft were verified
        planned = np.where(lengths == 0, 1.0 + a[:, 0], per_step)
        with np.errstate(divide="ignore"):
            worst = min(float(np.min(planned / floors * steps)), 1.0)
        return (per_step.sum() + plain_requests) * steps, worst

    theta, worst = evaluate(0)
    for n, (r, j, survival) in enumerate(order, start=1):
        per_step[r] += survival
        new_theta, new_worst = evaluate(n)
        keep = new_theta > theta and (worst < 1.0 or new_worst >= 1.0)
        if not keep:
            break
        lengths[r], theta, worst = j, new_theta, new_worst
    return lengths


def test_a_binding_floor_verifies_less_than_dspark() -> None:
    assert select_verify_lengths(C_TWO, TWO, "dspark").tolist() == [1, 0]
    # Verifying request 0's token slows request 1 to 1.1 * 0.9 < 1 (as planned: its own
    # first draft counted) and to 0.9 in fact.
    plan = plan_sla(C_TWO, TWO, 1.0)
    assert plan.lengths.tolist() == [0, 0]
    assert plan.feasible and plan.tokens_per_s.tolist() == [1.0, 1.0]
    assert plan_sla(C_TWO, TWO, 0.85).lengths.tolist() == [1, 0]


def test_a_request_the_scan_never_reaches_is_reported_when_it_misses_its_floor() -> None:
    # Planned with its first draft (1.1 * 0.9 = 0.99 >= 0.95) but that draft is not worth
    # verifying, so request 1 actually runs at 0.9.
    plan = plan_sla(C_TWO, TWO, 0.95)
    assert plan.lengths.tolist() == [1, 0]
    assert plan.floor_met.tolist() == [True, False] and not plan.feasible


def test_unreached_requests_do_not_stop_the_scan_early() -> None:
    # Four requests at SPS(4) = 10.4 with a 10 tokens/s floor: a request with no verified
    # draft drops below 10 as soon as B > 5, but one verified draft each (1.8 * 8.9) meets
    # it easily; the scan must not stop after the first candidate.
    cpu = SpsCurve(points=[(1, 1000 / 84), (2, 1000 / 91), (4, 1000 / 96), (8, 1000 / 112)])
    plan = plan_sla(np.full((4, 1), 0.8), cpu, 10.0)
    assert plan.lengths.tolist() == [1, 1, 1, 1] and plan.feasible


def test_per_request_floors() -> None:
    assert plan_sla(C_TWO, TWO, np.array([0.0, 1.0])).lengths.tolist() == [0, 0]
    assert plan_sla(C_TWO, TWO, np.array([1.0, 0.0])).lengths.tolist() == [1, 0]
    assert select_verify_lengths(C_TWO, TWO, "sla", min_tokens_per_s=[1.0, 0.0]).tolist() == [1, 0]


def test_an_unreachable_floor_is_reported_and_throughput_still_maximised() -> None:
    plan = plan_sla([[0.5]], SpsCurve(points=[(1, 1.0), (2, 0.9)]), 10.0)
    assert plan.lengths.tolist() == [1]
    assert not plan.feasible and plan.floor_met.tolist() == [False]
    assert plan.tokens_per_s[0] == pytest.approx(1.5 * 0.9)
    assert plan.throughput == pytest.approx(1.35)


def test_unmet_equal_floors_do_not_collapse_to_no_speculation() -> None:
    # Verifying either request's token slows the other, so no single step raises the worst
    # user's speed; throughput decides, and verifying both raises everyone's (1.8 * 0.9 > 1.0).
    curve = SpsCurve(points=[(2, 1.0), (3, 0.95), (4, 0.9)])
    plan = plan_sla(np.array([[0.8], [0.8]]), curve, 5.0)
    assert plan.lengths.tolist() == [1, 1]
    assert not plan.feasible
    np.testing.assert_allclose(plan.tokens_per_s, [1.8 * 0.9, 1.8 * 0.9])


def test_an_unmet_floor_buys_no_draft_that_costs_throughput() -> None:
    # Request 0 cannot reach 5 tokens/s. Its first draft raises throughput (2.0 -> 2.6 * 0.9
    # = 2.34); its second would lift its own ratio (1.6 * 0.9 / 5 = 0.288 -> 2.14 * 0.7 / 5 =
    # 0.2996) at a loss of throughput (3.14 * 0.7 = 2.198): under overload that loses for all.
    curve = SpsCurve(points=[(2, 1.0), (3, 0.9), (4, 0.7), (5, 0.5)])
    plan = plan_sla(np.array([[0.6, 0.9], [1.0, 1.0]]), curve, np.array([5.0, 0.0]))
    assert plan.lengths.tolist() == [1, 0] and not plan.feasible
    assert plan.throughput == pytest.approx(2.34)


def test_a_high_floor_can_be_reached_by_verifying_the_request_s_own_drafts() -> None:
    # Request 0 needs 1.5 tokens/s: only its own verified draft gets it there.
    curve = SpsCurve(points=[(2, 1.0), (3, 0.95), (4, 0.5)])
    plan = plan_sla(np.array([[0.9], [0.9]]), curve, np.array([1.5, 0.5]))
    assert plan.lengths.tolist() == [1, 0] and plan.feasible
    assert plan.tokens_per_s.tolist() == pytest.approx([1.9 * 0.95, 0.95])


def test_zero_floors_equal_dspark() -> None:
    rng = np.random.default_rng(0)
    curve = SpsCurve(points=[(1, 12.0), (8, 9.0), (64, 3.2), (128, 2.1)])
    for _ in range(20):
        c = rng.uniform(0, 1, size=(int(rng.integers(1, 40)), 7))
        np.testing.assert_array_equal(
            select_verify_lengths(c, curve, "sla", min_tokens_per_s=0.0),
            select_verify_lengths(c, curve, "dspark"),
        )


def test_report_is_consistent_with_the_lengths() -> None:
    c = np.array([[0.9, 0.8], [0.5, 0.5], [0.2, 0.9]])
    curve = SpsCurve(points=[(1, 10.0), (9, 6.0)])
    plan = plan_sla(c, curve, 9.0)
    per_step = 1 + np.array([np.cumprod(row)[:l].sum() for row, l in zip(c, plan.lengths)])
    steps = curve(3 + plan.lengths.sum())
    np.testing.assert_allclose(plan.tokens_per_s, per_step * steps)
    assert plan.throughput == pytest.approx(plan.tokens_per_s.sum())
    assert plan.floor_met.tolist() == (plan.tokens_per_s >= 9.0).tolist()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), [1.0, 2.0]])
def test_bad_floors_raise(bad) -> None:
    with pytest.raises(ValueError):
        plan_sla(np.full((3, 2), 0.5), TWO, bad)


def test_sla_needs_a_floor() -> None:
    with pytest.raises(ValueError, match="min_tokens_per_s"):
        select_verify_lengths(C_TWO, TWO, "sla")


def test_empty_plan() -> None:
    plan = plan_sla(np.zeros((2, 0)), TWO, 1.5)
    assert plan.lengths.tolist() == [0, 0] and not plan.feasible
    assert plan.throughput == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(200))
def test_sla_matches_the_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_requests, block = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    c = rng.choice([0.0, 0.3, 0.6, 0.8, 0.95, 1.0], size=(num_requests, block))
    sizes = np.cumsum(rng.integers(1, 4, size=6))
    curve = SpsCurve(points=list(zip(sizes.tolist(), rng.uniform(0.3, 1.0, size=6).tolist())))
    floors = rng.uniform(0.0, 2.5, size=num_requests) * (rng.random(num_requests) < 0.8)
    base = int(rng.integers(0, 3))
    plain = int(rng.integers(0, base + 1))
    np.testing.assert_array_equal(
        plan_sla(c, curve, floors, base_tokens=base, plain_requests=plain).lengths,
        reference_sla(c, curve, floors, base, plain),
    )
