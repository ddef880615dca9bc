"""Every row of a closed-loop frontier run against one base row, turn by turn and request
by request.

`serve_frontier.py` rates a closed-loop turn by its median request, so a row's per-user
speed rests on as many medians as it has turns (four, say, of twelve requests each) and two
identical engines differ by 0.95-1.05x. Every row served the same prompts with the same
output lengths in the same order, so its requests also pair one to one with the base
row's: the median of those ratios, with a bootstrap interval, says how the typical
request fared, and the pooled median request (every turn's requests together) is the
per-user speed over all of them rather than over a few turn medians. The machine's load
moves whole turns (every request of a turn shares its engine's stretch of time), so the
interval that resamples requests one by one is too narrow when turns differ; a second one
resamples whole turns with their requests.

vLLM's own Pareto plot (`vllm bench sweep plot_pareto`) counts per-user speed as output
throughput over the number of users; in a closed loop each of R users always has a request
in flight, so that is each user's tokens over the run, the mean user's speed, and the
turns' throughput ratio (the same tokens in every row) is reported beside ours.

    python benchmarks/pair_rows.py benchmarks/results/closed_loop/code_paired.json --base ngram-k3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

RESAMPLES = 2000


def median_interval(values: np.ndarray, seed: int = 0, level: float = 0.95, turns: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of `values`, resampling whole turns:
    `values` holds `turns` equal runs of consecutive values, one per turn (0: every value
    is a turn of its own, i.e. values resampled one by one)."""
    turns = turns or len(values)
    if len(values) % turns:
        raise ValueError(f"{len(values)} values do not split into {turns} equal turns")
    by_turn = np.asarray(values).reshape(turns, -1)
    picked = by_turn[np.random.default_rng(seed).integers(0, turns, size=(RESAMPLES, turns))]  # [resample, turn, value]
    medians = np.median(picked.reshape(RESAMPLES, -1), axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def compare(row: dict, base: dict) -> dict:
    """Turn-paired and request-paired speed ratios of `row` against `base` (one R)."""
    turns = [ours / theirs for ours, theirs in zip(row["turns_per_user_tok_s"], base["turns_per_user_tok_s"])]
    ours, theirs = np.array(row["requests_tok_s"]), np.array(base["requests_tok_s"])
    if len(ours) != len(theirs) or row["tokens"] != base["tokens"]:
        raise ValueError(f"rows served {len(ours)} and {len(theirs)} requests ({row['tokens']} and {base['tokens']} tokens) "
                         f"at R = {row['concurrency']}: not paired")
    ratios = ours / theirs
    return {
        "concurrency": row["concurrency"],
        "turns_median": statistics.median(turns),
        "turns_range": (min(turns), max(turns)),
        "requests": len(ratios),
        "requests_median": float(np.median(ratios)),
        "requests_interval": median_interval(ratios),
        "turns_resampled_interval": median_interval(ratios, turns=len(turns)),
        "pooled_median_ratio": float(np.median(ours) / np.median(theirs)),
        # the same tokens in the same turn of every row: throughput ratio = inverse time ratio
        "throughput_median": statistics.median(
            theirs_s / ours_s for ours_s, theirs_s in zip(row["waves_seconds"], base["waves_seconds"])),
    }


def report(results: dict[str, list[dict]], base_name: str) -> list[str]:
    base = {row["concurrency"]: row for row in results[base_name]}
    lines = [
        f"Against `{base_name}`: per turn, the ratio of the turns' median requests (median, min-max over turns); "
        "per request, the median of the requests' speed ratios (95% bootstrap intervals: requests resampled; "
        "whole turns resampled, which counts the machine's turn-to-turn drift); pooled, the ratio of "
        "the median requests over every turn; vLLM's per user, the median over turns of the throughput ratio "
        "(output throughput over users, `plot_pareto`'s tokens per user).",
        "",
        "| configuration | R | per turn | per request (95% interval) | turns resampled | pooled median request "
        "| vLLM's per user |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        if name == base_name:
            continue
        for row in rows:
            if row["concurrency"] not in base or "requests_tok_s" not in row:
                continue
            c = compare(row, base[row["concurrency"]])
            (low, high), (first, last) = c["requests_interval"], c["turns_range"]
            turn_low, turn_high = c["turns_resampled_interval"]
            lines.append(f"| {name} | {c['concurrency']} | {c['turns_median']:.3f}x ({first:.2f}-{last:.2f}) "
                         f"| {c['requests_median']:.3f}x ({low:.3f}-{high:.3f}, {c['requests']} requests) "
                         f"| {turn_low:.3f}-{turn_high:.3f} "
                         f"| {c['pooled_median_ratio']:.3f}x | {c['throughput_median']:.3f}x |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a serve_frontier.py JSON of a closed-loop run")
    parser.add_argument("--base", default="ngram-k3", help="the row every other row is paired with")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())["results"]
    if args.base not in results:
        parser.error(f"no row {args.base!r} in {args.results}; rows: {', '.join(results)}")
    print("\n".join(report(results, args.base)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
