"""benchmarks/pair_rows.py: rows of a closed-loop run paired turn by turn and request by request."""

from __future__ import annotations

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark


def load_script():
    return load_benchmark("pair_rows")


def row(r: int, turns: list[float], requests: list[float], seconds: list[float] | None = None) -> dict:
    return {"concurrency": r, "turns_per_user_tok_s": turns, "requests_tok_s": requests,
            "waves_seconds": seconds or [1.0] * len(turns), "tokens": 100}


def test_requests_pair_one_to_one_and_turns_by_repeat():
    pair = load_script()
    base = row(4, [10.0, 20.0], [10.0, 10.0, 20.0, 40.0, 5.0, 8.0], seconds=[6.0, 8.0])
    # a row twice as fast on every request but the fifth, which it halves (two turns of three)
    ours = row(4, [22.0, 40.0], [20.0, 20.0, 40.0, 80.0, 2.5, 16.0], seconds=[4.0, 5.0])
    c = pair.compare([(ours, base)])
    assert c["requests"] == 6 and c["requests_median"] == 2.0
    low, high = c["requests_interval"]
    assert 0.5 <= low <= 2.0 <= high <= 2.0 + 1e-12
    turn_low, turn_high = c["turns_resampled_interval"]
    assert 0.5 <= turn_low <= 2.0 <= turn_high <= 2.0 + 1e-12
    assert c["turns_median"] == pytest.approx(2.1) and c["turns_range"] == pytest.approx((2.0, 2.2))
    assert c["pooled_median_ratio"] == 2.0  # medians 20 against 10
    assert c["throughput_median"] == pytest.approx((6 / 4 + 8 / 5) / 2)  # its turns' times against the base's
    vllm_low, vllm_high = c["throughput_interval"]  # medians of resampled turns lie between the two turns
    assert 6 / 4 <= vllm_low <= c["throughput_median"] <= vllm_high <= 8 / 5


def test_unpaired_rows_are_refused():
    pair = load_script()
    with pytest.raises(ValueError, match="not paired"):
        pair.compare([(row(4, [1.0], [1.0, 2.0]), row(4, [1.0], [1.0]))])
    with pytest.raises(ValueError, match="not paired"):  # other prompts or lengths: other tokens
        pair.compare([(row(4, [1.0], [1.0]), row(4, [1.0], [1.0]) | {"tokens": 99})])


def test_the_bootstrap_interval_narrows_with_more_requests():
    pair = load_script()
    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 0.1, 12), rng.normal(1.0, 0.1, 480)
    width = [high - low for low, high in (pair.median_interval(few), pair.median_interval(many))]
    assert width[1] < width[0] / 2


def test_resampling_whole_turns_counts_their_drift():
    pair = load_script()
    rng = np.random.default_rng(2)
    # six turns of 48 requests; each turn's load moves all its ratios together
    drift = np.repeat(rng.normal(1.0, 0.05, 6), 48)
    ratios = drift * rng.normal(1.0, 0.02, 6 * 48)
    by_request, by_turn = pair.median_interval(ratios), pair.median_interval(ratios, turns=6)
    assert by_turn[1] - by_turn[0] > 2 * (by_request[1] - by_request[0])
    assert by_turn[0] <= np.median(ratios) <= by_turn[1]
    with pytest.raises(ValueError, match="equal turns"):
        pair.median_interval(ratios[:-1], turns=6)


def test_report_lists_every_other_row_at_every_shared_concurrency():
    pair = load_script()
    results = {"base": [row(1, [1.0], [1.0, 1.0]), row(4, [1.0], [1.0, 1.0])],
               "hybrid": [row(1, [1.5], [1.5, 1.5]), row(4, [0.9], [0.9, 0.9]), row(16, [1.0], [1.0, 1.0])]}
    lines = pair.report(pair.pooled_pairs([(results, {"hybrid": "hybrid"})], "base"), "base")
    rows = [line for line in lines if line.startswith("| hybrid")]
    assert len(rows) == 2 and "| 1 | 1 (1) | 1.500x" in rows[0] and "| 4 | 1 (1) | 0.900x" in rows[1]


def test_runs_pool_turns_and_requests_each_paired_with_its_own_base():
    pair = load_script()
    # the same row under another name in the second run, whose base is twice as fast
    first = {"base": [row(4, [1.0], [1.0, 1.0])], "hybrid": [row(4, [1.2], [1.2, 1.2])]}
    second = {"base": [row(4, [2.0, 2.0], [2.0, 2.0, 2.0, 2.0])],
              "hybrid @ abc": [row(4, [1.6, 1.6], [1.6, 1.6, 1.6, 1.6])]}
    pairs = pair.pooled_pairs([(first, {"hybrid": "hybrid"}), (second, {"hybrid @ abc": "hybrid"})], "base")
    c = pair.compare(pairs["hybrid"][4])
    assert (c["runs"], c["turns"], c["requests"]) == (2, 3, 6)
    assert c["turns_range"] == pytest.approx((0.8, 1.2)) and c["requests_median"] == pytest.approx(0.8)
    assert c["pooled_median_ratio"] == pytest.approx(1.6 / 2.0)  # every request of both runs together
    with pytest.raises(ValueError, match="requests per turn"):
        third = {"base": [row(4, [1.0], [1.0, 1.0, 1.0])], "hybrid": [row(4, [1.0], [1.0, 1.0, 1.0])]}
        pair.compare(pairs["hybrid"][4] + pair.pooled_pairs([(third, {"hybrid": "hybrid"})], "base")["hybrid"][4])
