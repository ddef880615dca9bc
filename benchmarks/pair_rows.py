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

One run of eight turns leaves intervals about 4% wide either side at R = 4 and 16, and
runs of the same engines moved by that much from one hour to the next. With `--row`,
several runs of the same plugin code are pooled instead: each file's requests pair with
its own base row as above, then every turn of every file counts as one turn of a single
sample (turns resampled across files). A file given as `PATH=ROW` names the row that
stands for `--row` there (a row kept under a commit's name, say):

    cd benchmarks/results/closed_loop
    python ../../pair_rows.py --row "dspark + n-gram" --base ngram-k3 \\
        code_r4_r16_three_rows.json "code_ngram_history.json=dspark + n-gram @ a55ca81"
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


def compare(pairs: list[tuple[dict, dict]]) -> dict:
    """Turn-paired and request-paired speed ratios of a row against its base at one R, over
    the (row, base) pairs of one run or several (their turns and requests pooled, turns
    resampled across runs)."""
    turns, ours_runs, theirs_runs, throughput = [], [], [], []
    for row, base in pairs:
        ours, theirs = np.array(row["requests_tok_s"]), np.array(base["requests_tok_s"])
        if len(ours) != len(theirs) or row["tokens"] != base["tokens"] or row["concurrency"] != base["concurrency"]:
            raise ValueError(f"rows served {len(ours)} and {len(theirs)} requests ({row['tokens']} and {base['tokens']} "
                             f"tokens) at R = {row['concurrency']} and {base['concurrency']}: not paired")
        run_turns = [a / b for a, b in zip(row["turns_per_user_tok_s"], base["turns_per_user_tok_s"])]
        if ours_runs and len(ours) * len(turns) != sum(map(len, ours_runs)) * len(run_turns):
            raise ValueError("runs with different requests per turn cannot be pooled")
        turns += run_turns
        ours_runs.append(ours)
        theirs_runs.append(theirs)
        # the same tokens in the same turn of every row: throughput ratio = inverse time ratio
        throughput += [theirs_s / ours_s for ours_s, theirs_s in zip(row["waves_seconds"], base["waves_seconds"])]
    ours_all, theirs_all = np.concatenate(ours_runs), np.concatenate(theirs_runs)
    ratios = ours_all / theirs_all
    return {
        "concurrency": pairs[0][0]["concurrency"],
        "runs": len(pairs),
        "turns": len(turns),
        "turns_median": statistics.median(turns),
        "turns_range": (min(turns), max(turns)),
        "requests": len(ratios),
        "requests_median": float(np.median(ratios)),
        "requests_interval": median_interval(ratios),
        "turns_resampled_interval": median_interval(ratios, turns=len(turns)),
        "pooled_median_ratio": float(np.median(ours_all) / np.median(theirs_all)),
        "throughput_median": statistics.median(throughput),
        # one ratio per turn, so resampling them one by one resamples turns
        "throughput_interval": median_interval(np.array(throughput)),
    }


Pairs = dict[str, dict[int, list[tuple[dict, dict]]]]  # row name -> R -> (row, base) per run


def pooled_pairs(runs: list[tuple[dict[str, list[dict]], dict[str, str]]], base_name: str) -> Pairs:
    """Rows of several runs beside each run's base row: per run, its results and which of
    its rows stand for which reported name."""
    pairs: Pairs = {}
    for results, names in runs:
        base = {row["concurrency"]: row for row in results[base_name]}
        for in_run, reported in names.items():
            for row in results[in_run]:
                if row["concurrency"] in base and "requests_tok_s" in row:
                    pairs.setdefault(reported, {}).setdefault(row["concurrency"], []).append(
                        (row, base[row["concurrency"]]))
    return pairs


def report(pairs: Pairs, base_name: str) -> list[str]:
    lines = [
        f"Against `{base_name}`: per turn, the ratio of the turns' median requests (median, min-max over turns); "
        "per request, the median of the requests' speed ratios (95% bootstrap intervals: requests resampled; "
        "whole turns resampled, which counts the machine's turn-to-turn drift); pooled, the ratio of "
        "the median requests over every turn; vLLM's per user, the median over turns of the throughput ratio "
        "(output throughput over users, `plot_pareto`'s tokens per user; turns resampled).",
        "",
        "| configuration | R | runs (turns) | per turn | per request (95% interval) | turns resampled "
        "| pooled median request | vLLM's per user |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_concurrency in pairs.items():
        for concurrency in sorted(by_concurrency):
            c = compare(by_concurrency[concurrency])
            (low, high), (first, last) = c["requests_interval"], c["turns_range"]
            turn_low, turn_high = c["turns_resampled_interval"]
            vllm_low, vllm_high = c["throughput_interval"]
            lines.append(f"| {name} | {concurrency} | {c['runs']} ({c['turns']}) "
                         f"| {c['turns_median']:.3f}x ({first:.2f}-{last:.2f}) "
                         f"| {c['requests_median']:.3f}x ({low:.3f}-{high:.3f}, {c['requests']} requests) "
                         f"| {turn_low:.3f}-{turn_high:.3f} "
                         f"| {c['pooled_median_ratio']:.3f}x "
                         f"| {c['throughput_median']:.3f}x ({vllm_low:.3f}-{vllm_high:.3f}) |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="serve_frontier.py JSONs of closed-loop runs (PATH=ROW with --row)")
    parser.add_argument("--base", default="ngram-k3", help="the row every other row is paired with")
    parser.add_argument("--row", default=None, help="pool this row over every run given (module docstring)")
    args = parser.parse_args()
    if args.row is None and (len(args.results) > 1 or "=" in args.results[0]):
        parser.error("several runs, or PATH=ROW, need the --row they pool")
    runs = []
    for given in args.results:
        path, _, in_run = given.partition("=")
        results = json.loads(Path(path).read_text())["results"]
        names = {in_run or args.row: args.row} if args.row else {name: name for name in results if name != args.base}
        for name in [args.base, *names]:
            if name not in results:
                parser.error(f"no row {name!r} in {path}; rows: {', '.join(results)}")
        runs.append((results, names))
    print("\n".join(report(pooled_pairs(runs, args.base), args.base)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
