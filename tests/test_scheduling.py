"""SpsCurve and the verification-length policies on hand-checkable cases and against a
literal transcription of DSPARK.md section 4."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_dspark.scheduling import POLICIES, SpsCurve, dspark_budget, select_verify_lengths
from vllm_dspark.scheduling.policies import EARLY_STOP_MARGIN, DSparkPolicy, PolicyStep
from vllm_dspark.scheduling.ranking import decoding_part, rank_by_user_gain, tail_from

FLAT = SpsCurve(points=[(1, 10.0)])
COUNTER_EXAMPLE = SpsCurve(points=[(1, 1.0), (2, 0.5), (3, 0.45)])
OPTIONS = {"dspark_async": {"budget": 3}, "sla": {"min_tokens_per_s": 1.0}}


def reference_order(c: np.ndarray) -> list[tuple[int, int, float]]:
    """(r, j, a) with a > 0 sorted by a descending, then j, then r (j 1-based)."""
    a = np.cumprod(c, axis=1)
    slots = [(r, j + 1, a[r, j]) for r in range(c.shape[0]) for j in range(c.shape[1])]
    return sorted((s for s in slots if s[2] > 0), key=lambda s: (-s[2], s[1], s[0]))


def reference_dspark(c: np.ndarray, sps, base_tokens: int = 0, plain_requests: int = 0) -> np.ndarray:
    """DSPARK.md section 4, line by line (plain requests: one token each, nothing to verify;
    the other base tokens are a prompt, whose own time is not charged to the drafts)."""
    num_requests = c.shape[0]
    decoding, prompt = num_requests + plain_requests, base_tokens - plain_requests
    decode_only = 1.0 / float(sps(decoding))
    prompt_time = 1.0 / float(sps(decoding + prompt)) - decode_only

    def throughput(tau: float, batch: int) -> float:  # with a prompt, a jagged curve's dips stop at half a decode step
        step_time = 1.0 / float(sps(batch)) - prompt_time
        return tau / (max(step_time, 0.5 * decode_only) if prompt else step_time)

    lengths = np.zeros(num_requests, dtype=np.int64)
    batch, tau = base_tokens + num_requests, float(num_requests + plain_requests)
    best, chosen = throughput(tau, batch), lengths.copy()
    for r, j, a in reference_order(c):
        lengths[r] = j
        batch += 1
        tau += a
        theta = throughput(tau, batch)
        if theta > best:
            best, chosen = theta, lengths.copy()
        else:
            break
    return chosen


def reference_budget(c: np.ndarray, sps, base_tokens: int = 0, plain_requests: int = 0) -> int:
    """Full scan: the prefix length of the reference order with the largest tau * SPS(B)."""
    num_requests = c.shape[0]
    tau = float(num_requests + plain_requests)
    best, best_n = tau * float(sps(base_tokens + num_requests)), 0
    for n, (_, _, a) in enumerate(reference_order(c), start=1):
        tau += a
        theta = tau * float(sps(base_tokens + num_requests + n))
        if theta > best:
            best, best_n = theta, n
    return best_n


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, SpsCurve]:
    """Small random confidences (coarse values, so ties and zeros occur) and a jagged curve."""
    shape = (int(rng.integers(1, 6)), int(rng.integers(1, 5)))
    c = rng.choice([0.0, 0.25, 0.5, 0.75, 0.9, 1.0], size=shape)
    sizes = np.cumsum(rng.integers(1, 4, size=int(rng.integers(1, 7))))
    sps = rng.uniform(0.2, 1.0, size=len(sizes))
    return c, SpsCurve(points=list(zip(sizes.tolist(), sps.tolist())))


# --- SpsCurve -----------------------------------------------------------------------------


def test_sps_interpolates_step_time_and_extrapolates_the_tail() -> None:
    curve = SpsCurve(points=[(1, 10.0), (3, 5.0)])  # step times 0.1 s and 0.2 s
    assert curve(2) == pytest.approx(1 / 0.15)  # linear in time, not in SPS (7.5)
    assert curve(0) == pytest.approx(10.0)  # below the first point: the first
    assert curve(5) == pytest.approx(1 / 0.3)  # tail: +0.05 s per token
    np.testing.assert_allclose(curve(np.array([1, 2, 3])), [10.0, 1 / 0.15, 5.0])
    assert isinstance(curve(2), float)
    assert curve(np.array([[1, 3]])).shape == (1, 2)


def test_sps_single_point_is_constant_and_a_falling_tail_is_clamped() -> None:
    assert FLAT(1000) == pytest.approx(10.0)
    assert SpsCurve(points=[(1, 5.0), (2, 10.0)])(50) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([], "at least one"),
        ([(0, 1.0)], ">= 1"),
        ([(2, 1.0), (2, 0.5)], "strictly increasing"),
        ([(4, 1.0), (2, 0.5)], "strictly increasing"),
        ([(1, 0.0)], "> 0"),
        ([(1, -1.0)], "> 0"),
        ([(1, float("nan"))], "finite"),
        ([(1, float("inf"))], "finite"),
        ([(1.5, 1.0)], "integer"),
    ],
)
def test_sps_rejects_bad_points(points: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpsCurve(points=points)


def test_sps_json_round_trip(tmp_path) -> None:
    curve = SpsCurve(points=[(1, 11.9), (8, 8.9), (128, 2.1)], metadata={"model": "m", "dtype": "fp32"})
    path = tmp_path / "sps.json"
    curve.save(path)
    loaded = SpsCurve.load(path)
    assert loaded == curve
    np.testing.assert_array_equal(loaded(np.arange(1, 300)), curve(np.arange(1, 300)))


def test_sps_load_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        SpsCurve.load(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        SpsCurve.load(broken)
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({"points": [[1, 2.0], [1, 3.0]]}))
    with pytest.raises(ValueError, match="(?s)invalid.json.*strictly increasing"):
        SpsCurve.load(invalid)


def test_sps_over_range_is_the_curve_on_consecutive_batches() -> None:
    curve = SpsCurve(points=[(1, 11.9), (8, 8.9), (128, 2.1)])
    for first, count in [(0, 1), (5, 10), (60, 10), (100, 1000), (3, 2)]:
        np.testing.assert_array_equal(
            curve.over_range(first, count), curve(np.arange(first, first + count))
        )


# --- input validation shared by all policies ----------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_and_out_of_range_confidences_raise(policy: str) -> None:
    options = OPTIONS.get(policy, {})
    with pytest.raises(ValueError, match="NaN"):
        select_verify_lengths([[0.5, np.nan]], FLAT, policy, **options)
    for bad in (1.5, -0.1, np.inf):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            select_verify_lengths([[0.5, bad]], FLAT, policy, **options)


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2), ()])
def test_wrong_ndim_raises(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2-D"):
        select_verify_lengths(np.full(shape, 0.5), FLAT)


def test_unknown_policy_lists_the_policies() -> None:
    with pytest.raises(ValueError, match="dspark_async"):
        select_verify_lengths([[0.5]], FLAT, "greedy")


def test_unknown_option_and_negative_base_tokens_raise() -> None:
    with pytest.raises(ValueError, match="threshold"):
        select_verify_lengths([[0.5]], FLAT, "dspark", threshold=0.3)
    with pytest.raises(ValueError, match="base_tokens"):
        select_verify_lengths([[0.5]], FLAT, base_tokens=-1)


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_shapes(policy: str) -> None:
    options = OPTIONS.get(policy, {})
    out = select_verify_lengths(np.zeros((3, 0)), FLAT, policy, **options)
    assert out.dtype == np.int64 and out.tolist() == [0, 0, 0]
    assert select_verify_lengths(np.zeros((0, 5)), FLAT, policy, **options).shape == (0,)


@pytest.mark.parametrize("policy", POLICIES)
def test_all_zero_confidences_verify_nothing_except_fixed(policy: str) -> None:
    expected = 4 if policy == "fixed" else 0
    out = select_verify_lengths(np.zeros((3, 4)), FLAT, policy, **OPTIONS.get(policy, {}))
    assert out.tolist() == [expected] * 3


@pytest.mark.parametrize("policy", POLICIES)
def test_all_one_confidences_on_a_flat_curve_verify_everything(policy: str) -> None:
    options = {"dspark_async": {"budget": 12}}.get(policy, OPTIONS.get(policy, {}))
    out = select_verify_lengths(np.ones((3, 4)), FLAT, policy, **options)
    assert out.tolist() == [4, 4, 4]


# --- fixed and threshold ----------------------------------------------------------------


def test_fixed_default_clip_and_errors() -> None:
    c = np.full((2, 3), 0.5)
    assert select_verify_lengths(c, FLAT, "fixed").tolist() == [3, 3]
    assert select_verify_lengths(c, FLAT, "fixed", k=2).tolist() == [2, 2]
    assert select_verify_lengths(c, FLAT, "fixed", k=0).tolist() == [0, 0]
    assert select_verify_lengths(c, FLAT, "fixed", k=9).tolist() == [3, 3]
    with pytest.raises(ValueError, match="k >= 0"):
        select_verify_lengths(c, FLAT, "fixed", k=-1)


def test_threshold_cuts_on_prefix_survival() -> None:
    c = np.array([[0.9, 0.9, 0.9], [0.5, 1.0, 1.0], [0.4, 1.0, 1.0]])  # a0 = .9 .81 .729
    assert select_verify_lengths(c, FLAT, "threshold", threshold=0.8).tolist() == [2, 0, 0]
    assert select_verify_lengths(c, FLAT, "threshold", threshold=0.5).tolist() == [3, 3, 0]
    assert select_verify_lengths(c, FLAT, "threshold", threshold=0.0).tolist() == [3, 3, 3]
    assert select_verify_lengths(c, FLAT, "threshold").tolist() == [3, 3, 0]  # default 0.5
    with pytest.raises(ValueError, match="threshold"):
        select_verify_lengths(c, FLAT, "threshold", threshold=1.5)


# --- dspark ------------------------------------------------------------------------------


def test_dspark_counter_example_stops_at_zero() -> None:
    for c2 in (0.9, 0.0):
        assert select_verify_lengths([[0.8, c2]], COUNTER_EXAMPLE).tolist() == [0]


def test_dspark_single_token_hand_cases() -> None:
    # theta(0) = 1 * 1; theta(1) = 1.5 * SPS(2)
    assert select_verify_lengths([[0.5]], SpsCurve(points=[(1, 1.0), (2, 0.7)])).tolist() == [1]
    assert select_verify_lengths([[0.5]], SpsCurve(points=[(1, 1.0), (2, 0.6)])).tolist() == [0]
    # equal throughput is not a strict improvement
    assert select_verify_lengths([[0.5]], SpsCurve(points=[(1, 3.0), (2, 2.0)])).tolist() == [0]


def test_dspark_stops_at_a_cliff_that_the_full_scan_passes() -> None:
    jagged = SpsCurve(points=[(1, 1.0), (2, 0.5), (4, 0.5)])
    c = np.full((1, 3), 0.9)  # tau = 1, 1.9, 2.71, 3.439; theta = 1, .95, 1.355, 1.72
    assert select_verify_lengths(c, jagged, "dspark").tolist() == [0]
    assert dspark_budget(c, jagged) == 3
    assert select_verify_lengths(c, jagged, "dspark_async", budget=3).tolist() == [3]


def primed_dspark(history: np.ndarray, sps) -> DSparkPolicy:
    """A dspark policy that has seen one earlier step (the engine's controller keeps one)."""
    policy = DSparkPolicy()
    policy.lengths(PolicyStep(np.asarray(history, dtype=np.float64), sps))
    return policy


def test_dspark_with_history_steps_over_a_cliff_the_plain_early_stop_stops_at() -> None:
    jagged = SpsCurve(points=[(1, 1.0), (2, 0.5), (4, 0.5)])
    c = np.full((1, 3), 0.9)  # tau = 1, 1.9, 2.71, 3.439; theta = 1, .95, 1.355, 1.72
    policy = DSparkPolicy()
    assert policy.lengths(PolicyStep(c, jagged)).tolist() == [0]  # first call: the plain stop
    # Now the previous ranked survivals (0.9, 0.81, 0.729) predict the tail: crossing pays.
    assert policy.lengths(PolicyStep(c, jagged)).tolist() == [3]
    # A history of weak drafts predicts no gain past the cliff, whatever this step holds.
    assert primed_dspark([[0.2, 0.1, 0.1]], jagged).lengths(PolicyStep(c, jagged)).tolist() == [0]
    # The estimate is capped by the candidate's own survival: (1 + 0.3 + 0.3 + 0.3) * 0.5 < 1.
    assert primed_dspark(c, jagged).lengths(PolicyStep(np.array([[0.3, 1.0, 1.0]]), jagged)).tolist() == [0]


def test_dspark_history_is_rescaled_to_the_number_of_requests() -> None:
    # One request's ranked survivals read for two requests: each rank twice, then nothing.
    np.testing.assert_array_equal(tail_from(np.array([0.9, 0.5]), 1, 2, 6), [0.9, 0.9, 0.5, 0.5, 0.0, 0.0])
    # Three requests' read for one: every third rank (the fourth does not exist).
    np.testing.assert_array_equal(tail_from(np.array([0.9, 0.8, 0.5]), 3, 1, 3), [0.9, 0.0, 0.0])


def test_base_tokens_count_in_the_batch() -> None:
    # One token per request costs little at B = 1 -> 2 and much at B = 10 -> 11.
    curve = SpsCurve(points=[(1, 1.0), (2, 0.8), (10, 0.5), (11, 0.3)])
    assert select_verify_lengths([[0.5]], curve).tolist() == [1]  # 1.5 * .8 > 1
    assert select_verify_lengths([[0.5]], curve, base_tokens=9).tolist() == [0]  # 1.5 / (T(11) - T(10) + 1 s) < 1


def test_a_prompt_is_priced_apart_from_the_decoding_part_of_its_pass() -> None:
    """T'(B) = T(B + P) - (T(D + P) - T(D)): the decode-only step at B = D, each further
    token at the slope where the pass really is, and on a linear curve exactly the
    decode-only curve."""
    gpu = SpsCurve(points=[(1, 100.0), (64, 100.0), (1024, 1000 / 106.0)])  # flat, then 0.1 ms a token
    assert decoding_part(gpu, 0, 16) is gpu
    part = decoding_part(gpu, 500, 16)
    time = lambda sps, b: 1.0 / float(sps(np.asarray(float(b))))  # noqa: E731
    assert time(part, 16) == pytest.approx(time(gpu, 16))
    assert time(part, 17) - time(part, 16) == pytest.approx(time(gpu, 517) - time(gpu, 516))
    assert time(part, 17) > time(part, 16)  # while a decode-only pass of 17 costs no more
    linear = SpsCurve(points=[(1, 1000 / 32.0), (100, 1000 / 230.0), (1000, 1000 / 2030.0)])
    np.testing.assert_allclose(decoding_part(linear, 300, 8)(np.arange(8.0, 40.0)), linear(np.arange(8.0, 40.0)))
    # a curve that falls past the prompt by more than a decode step: half a decode step at least
    dipping = SpsCurve(points=[(1, 1.0), (4, 1 / 3.0), (7, 1 / 1.4)])
    assert time(decoding_part(dipping, 3, 1), 4) == pytest.approx(0.5)


def test_plain_requests_count_in_expected_tokens() -> None:
    """Decoding requests without drafts emit a token each and are slowed by every verified
    draft: counted, they raise the bar a draft must clear. A curve where one more token
    costs 20%: 0.3 pays alone (1.3 * 0.8 > 1) but not beside a plain request (2.3 * 0.8 < 2)."""
    curve = SpsCurve(points=[(1, 1.0), (2, 0.8), (3, 0.64)])
    assert select_verify_lengths([[0.3]], curve).tolist() == [1]
    assert select_verify_lengths([[0.3]], curve, base_tokens=1, plain_requests=1).tolist() == [0]
    # A prompt token emits nothing and its own time is not charged to the draft, but the
    # draft costs the slope where the pass is: 0.31 s there, against 0.25 s alone.
    assert select_verify_lengths([[0.3]], curve, base_tokens=1).tolist() == [0]
    with pytest.raises(ValueError, match="plain_requests"):
        select_verify_lengths([[0.3]], curve, base_tokens=0, plain_requests=1)


def test_dspark_verifies_less_as_load_grows() -> None:
    cpu = SpsCurve(points=[(1, 1000 / 84), (8, 1000 / 112), (64, 1000 / 308), (128, 1000 / 473)])
    c = np.full((1, 7), 0.8)
    light = select_verify_lengths(c, cpu).sum()
    heavy = select_verify_lengths(np.full((128, 7), 0.8), cpu).mean()
    assert light == 7 and heavy < 2


@pytest.mark.parametrize("seed", range(200))
def test_dspark_and_budget_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    c, curve = random_case(rng)
    base = int(rng.integers(0, 4))
    plain = int(rng.integers(0, base + 1))
    np.testing.assert_array_equal(
        select_verify_lengths(c, curve, "dspark", base_tokens=base, plain_requests=plain),
        reference_dspark(c, curve, base, plain),
    )
    assert dspark_budget(c, curve, base, plain) == reference_budget(c, curve, base, plain)


# --- dspark_async --------------------------------------------------------------------------


def test_async_top_slots_follow_the_documented_tie_order() -> None:
    # a = [[1, .5], [.5, .5]]: order (0,1) a=1; then the a=.5 ties by j, then r:
    # (1,1), (0,2), (1,2).
    c = np.array([[1.0, 0.5], [0.5, 1.0]])
    expected = {0: [0, 0], 1: [1, 0], 2: [1, 1], 3: [2, 1], 4: [2, 2], 10: [2, 2]}
    for budget, lengths in expected.items():
        assert select_verify_lengths(c, FLAT, "dspark_async", budget=budget).tolist() == lengths


def test_order_is_exact_for_values_one_ulp_apart() -> None:
    # Request 1's survival is larger by one ulp: it must come first despite its index.
    c = np.array([[0.5], [np.nextafter(0.5, 1.0)]])
    assert select_verify_lengths(c, FLAT, "dspark_async", budget=1).tolist() == [0, 1]
    c = np.array([[np.nextafter(0.5, 1.0)], [0.5]])
    assert select_verify_lengths(c, FLAT, "dspark_async", budget=1).tolist() == [1, 0]


def test_async_ties_across_requests_go_to_the_smaller_request() -> None:
    c = np.full((3, 2), 0.5)
    assert select_verify_lengths(c, FLAT, "dspark_async", budget=2).tolist() == [1, 1, 0]
    assert select_verify_lengths(c, FLAT, "dspark_async", budget=4).tolist() == [2, 1, 1]


def test_async_never_verifies_zero_survival_slots() -> None:
    c = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert select_verify_lengths(c, FLAT, "dspark_async", budget=5).tolist() == [1, 0]


def test_async_budget_errors() -> None:
    with pytest.raises(ValueError, match="dspark_budget"):
        select_verify_lengths([[0.5]], FLAT, "dspark_async")
    with pytest.raises(ValueError, match="budget >= 0"):
        select_verify_lengths([[0.5]], FLAT, "dspark_async", budget=-1)


def test_budget_of_empty_confidences_is_zero() -> None:
    assert dspark_budget(np.zeros((0, 4)), FLAT) == 0
    assert dspark_budget(np.zeros((4, 0)), FLAT) == 0


@pytest.mark.parametrize("seed", range(5))
def test_async_matches_the_reference_order_at_every_budget(seed: int) -> None:
    # Large and coarse, so there are many ties and the sort is not a small-array special case.
    rng = np.random.default_rng(seed)
    c = rng.choice([0.0, 0.5, 0.8, 1.0], size=(64, 5))
    order = reference_order(c)
    for budget in range(0, len(order) + 2, 7):
        expected = np.zeros(64, dtype=np.int64)
        for r, j, _ in order[:budget]:
            expected[r] = j
        got = select_verify_lengths(c, FLAT, "dspark_async", budget=budget)
        np.testing.assert_array_equal(got, expected)


# --- dspark's per-user objective -----------------------------------------------------------


def reference_per_user(c: np.ndarray, sps, base_tokens: int = 0, plain_requests: int = 0) -> np.ndarray:
    """The per-user scan, literally: slots by log-speed gain (ties: j, then r), stop at the
    first that does not raise sum_r log(1 + A_r) + R log SPS(B)."""
    num_requests = c.shape[0]
    a = np.cumprod(c, axis=1)
    expected = np.zeros(num_requests)
    gains = []
    for r in range(num_requests):
        before = 0.0
        for j in range(c.shape[1]):
            if a[r, j] > 0:
                gains.append((float(np.log1p(a[r, j] / (1.0 + before))), j + 1, r))
            before += a[r, j]
    lengths = np.zeros(num_requests, dtype=np.int64)
    batch, slowed = base_tokens + num_requests, num_requests + plain_requests
    best = slowed * np.log(float(sps(batch)))
    for _, j, r in sorted(gains, key=lambda g: (-g[0], g[1], g[2])):
        lengths[r], batch = j, batch + 1
        expected[r] += a[r, j - 1]
        utility = np.log1p(expected).sum() + slowed * np.log(float(sps(batch)))
        if utility <= best:
            lengths[r] = j - 1
            break
        best = utility
    return lengths


@pytest.mark.parametrize("seed", range(200))
def test_per_user_objective_matches_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    c, curve = random_case(rng)
    base = int(rng.integers(0, 4))
    plain = int(rng.integers(0, base + 1))
    got = DSparkPolicy("per_user").lengths(PolicyStep(c, curve, base, plain_requests=plain))
    np.testing.assert_allclose(got, reference_per_user(c, curve, base, plain))


@pytest.mark.parametrize("seed", range(50))
def test_per_user_objective_agrees_with_throughput_at_one_request(seed: int) -> None:
    # log((1 + A) SPS) rises exactly where (1 + A) SPS does, slot by slot in block order.
    rng = np.random.default_rng(seed)
    c, curve = random_case(rng)
    c = c[:1]
    np.testing.assert_array_equal(DSparkPolicy("per_user").lengths(PolicyStep(c, curve)),
                                  DSparkPolicy().lengths(PolicyStep(c, curve)))


def test_per_user_objective_charges_a_lone_request_s_slots_to_everyone_it_slows() -> None:
    # 16 requests on the CPU curve, one with a confident continuation: the tokens it gains
    # outweigh the longer pass for throughput, not for the product of the 16 speeds.
    cpu = SpsCurve(points=[(1, 45.7), (4, 42.9), (16, 28.1), (64, 8.77)])
    c = np.zeros((16, 7))
    c[0] = 0.9
    def served(objective: str, confidences: np.ndarray) -> np.ndarray:
        """A second call, as in the engine: the first one's ranked values are the history."""
        policy = DSparkPolicy(objective)  # type: ignore[arg-type]
        policy.lengths(PolicyStep(confidences, cpu))
        return policy.lengths(PolicyStep(confidences, cpu))

    throughput, per_user = served("throughput", c), served("per_user", c)
    assert throughput[0] >= 2 and per_user[0] < throughput[0]
    # Drafts as confident for every request still pay per user, though the first slot alone
    # costs the 16 requests more than it gains: the history shows the others coming.
    everyone = np.full((16, 7), 0.9)
    assert DSparkPolicy("per_user").lengths(PolicyStep(everyone, cpu)).sum() == 0
    assert (served("per_user", everyone) >= 1).all()


def test_per_user_order_keeps_each_request_s_block_in_position_order() -> None:
    rng = np.random.default_rng(0)
    c = rng.choice([0.0, 0.3, 0.6, 0.9, 1.0], size=(12, 6))
    order, gains = rank_by_user_gain(c)
    assert (np.diff(gains) <= 0).all()
    seen = np.zeros(12, dtype=np.int64)
    for r, j in zip(order.requests(), order.positions()):
        assert j == seen[r] + 1, "a request's slots come in block order"
        seen[r] = j


@pytest.mark.parametrize("objective", ["throughput", "per_user"])
@pytest.mark.parametrize("seed", range(20))
def test_no_slot_below_the_drafting_floor_is_ever_verified(objective: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    requests = int(rng.integers(1, 24))
    sizes = np.array([1, 4, 16, 64, 256])
    curve = SpsCurve(points=list(zip(sizes.tolist(), np.sort(rng.uniform(1.0, 50.0, 5))[::-1].tolist())))
    policy = DSparkPolicy(objective)
    bound = policy.min_survival(curve, requests, 7) / EARLY_STOP_MARGIN
    c = rng.uniform(0.0, 1.0, size=(requests, 7)) ** rng.uniform(0.1, 2.0)
    lengths = policy.lengths(PolicyStep(c, curve))
    survival = np.cumprod(c, axis=1)
    verified = np.arange(7) < lengths[:, None]
    assert (survival[verified] >= bound).all()


def test_unknown_objective_is_refused() -> None:
    with pytest.raises(ValueError, match="objective"):
        DSparkPolicy("fair")  # type: ignore[arg-type]
