"""Throughput against per-user speed in a real vLLM engine: vllm_dspark policies against
no speculation, a static one-draft (MTP-1-like) and an all-K fixed-length baseline, and
vLLM's n-gram speculation (the peer a CPU user can pick today).

Each configuration gets its own engine in a fresh process (vLLM 0.32's CPU kernel
overrides fail on a second engine in a process that ran n-gram speculation, and a fresh
process also returns all memory); for every concurrency R, R chat
prompts (eval prompts, mixed domains) run at once with exactly `--max-tokens` output
tokens each (ignore_eos), so per-user speed = max_tokens / wave time and system
throughput = R * max_tokens / wave time. Writes JSON, Markdown and a Pareto plot.

    python benchmarks/serve_frontier.py --drafter examples/drafters/smollm2-dspark-b7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from vllm_dspark.evaluation.dataset import default_eval_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# SmolLM2 steps/s on these CPUs (ENVIRONMENT.md step table); --sps-profile overrides it.
DEFAULT_SPS = [[1, 11.9], [2, 11.0], [4, 10.4], [8, 8.9], [16, 6.8], [32, 5.5], [64, 3.2], [128, 2.1]]


def eval_prompts(count: int) -> list[list[dict]]:
    """First user turns, round-robin over the three eval domains."""
    per_file = []
    for name in ("gsm8k.jsonl", "humaneval.jsonl", "mt-bench.jsonl"):
        lines = (default_eval_dir() / name).read_text().splitlines()
        per_file.append([json.loads(line)["turns"][0] for line in lines[:count]])
    mixed = [turns[i] for i in range(count) for turns in per_file]
    return [[{"role": "user", "content": text}] for text in mixed[:count]]


def configurations(drafter: str, k: int, sps_table: list, reduced: str | None = None) -> dict[str, dict]:
    def dspark(model: str = drafter, **plugin):
        return {
            "speculative_config": {"method": "vllm_dspark", "model": model, "num_speculative_tokens": k},
            "additional_config": {"vllm_dspark": plugin},
        }

    return {
        "no-spec": {},
        "ngram-k3": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
        "never drafting (fixed k=0)": dspark(policy="fixed", k=0),
        "fixed-k1 (MTP-1-like)": dspark(policy="fixed", k=1),
        f"fixed-k{k}": dspark(policy="fixed"),
        "dspark": dspark(policy="dspark", sps_table=sps_table),
        "dspark, drafting all K": dspark(policy="dspark", sps_table=sps_table, adaptive_drafting=False),
        "dspark_async": dspark(policy="dspark_async", sps_table=sps_table),
    } | ({} if reduced is None else {
        "fixed-k1, reduced vocabulary": dspark(reduced, policy="fixed", k=1),
        "dspark, reduced vocabulary": dspark(reduced, policy="dspark", sps_table=sps_table),
        "dspark_async, reduced vocabulary": dspark(reduced, policy="dspark_async", sps_table=sps_table),
    })


def run_configuration(target: str, settings: dict, concurrency: list[int], max_tokens: int, repeats: int) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_num_seqs=max(concurrency),
        max_model_len=2048,
        seed=0,
        disable_log_stats=False,
        **settings,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.chat(eval_prompts(1), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rows = []
    for r in concurrency:
        before = spec_counters(llm)
        plugin_before = plugin_stats(llm)
        waves = []
        for _ in range(repeats):  # the median wave: a shared machine has slow moments
            start = time.perf_counter()
            outputs = llm.chat(eval_prompts(r), params, use_tqdm=False)
            waves.append(time.perf_counter() - start)
        wave = statistics.median(waves)
        after = spec_counters(llm)
        plugin = plugin_stats(llm)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
        accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        verified = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
        rows.append(
            {
                "concurrency": r,
                "wave_seconds": wave,
                "throughput_tok_s": tokens / wave,
                "per_user_tok_s": max_tokens / wave,
                "verified_drafts_per_step": verified / drafts if drafts else 0.0,
                "accepted_length": 1.0 + accepted / drafts if drafts else 1.0,
                "wave_spread_seconds": [min(waves), max(waves)],
                **plugin_delta(plugin_before, plugin),
            }
        )
        print(f"  R={r:3d}: {tokens / wave:7.1f} tok/s total, {max_tokens / wave:6.2f} tok/s per user", flush=True)
    return rows


def plugin_stats(llm) -> dict | None:
    """The plugin's cumulative stats of an in-process engine (None without the plugin)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    controller = getattr(scheduler, "controller", None)
    if controller is None:
        return None
    stats = controller.stats
    return {"steps": sum(stats.draft_depth_counts), "depths": list(stats.draft_depth_counts),
            "lm_head_rows": stats.lm_head_rows, "drafting_seconds": stats.drafting_seconds}


def plugin_delta(before: dict | None, after: dict | None) -> dict:
    """Drafting in one concurrency's waves: share of steps that drafted nothing, mean
    depth, LM-head rows and drafting milliseconds per step."""
    if before is None or after is None:
        return {}
    steps = max(1, after["steps"] - before["steps"])
    depths = [a - (before["depths"][d] if d < len(before["depths"]) else 0) for d, a in enumerate(after["depths"])]
    return {
        "steps_without_drafting": depths[0] / steps if depths else 0.0,
        "mean_draft_depth": sum(d * n for d, n in enumerate(depths)) / steps,
        "lm_head_rows_per_step": (after["lm_head_rows"] - before["lm_head_rows"]) / steps,
        "drafting_ms_per_step": 1000.0 * (after["drafting_seconds"] - before["drafting_seconds"]) / steps,
    }


def spec_counters(llm) -> dict[str, int]:
    counts = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
    return counts


def write_results(results: dict, meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = [
        "# Serving frontier (real engine, CPU)",
        "",
        f"Target {meta['target']}, drafter {meta['drafter']}, K = {meta['k']}, {meta['max_tokens']} output "
        f"tokens per request (greedy, ignore_eos), chat prompts from gsm8k/humaneval/mt-bench, "
        f"median wave of {meta.get('repeats', 1)}. "
        f"Measured {meta['date']} on {meta['hardware']}; machine shared with other jobs, so compare "
        "rows within one run. `dspark, drafting all K` is the dspark policy with `adaptive_drafting: false` "
        "(the lever A/B); `reduced vocabulary` rows serve the same drafter with its LM head cut to "
        f"{meta.get('reduced_vocab', '?')} tokens (`vllm-dspark reduce-vocab`).",
        "",
        "| configuration | R | system tok/s | per-user tok/s (min-max wave) | vs no-spec | accepted length (steps with drafts) "
        "| verified drafts/step | steps without drafting | mean draft depth | drafting ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {row["concurrency"]: row["per_user_tok_s"] for row in results.get("no-spec", [])}
    for name, rows in results.items():
        for row in rows:
            fastest, slowest = (meta["max_tokens"] / w for w in row["wave_spread_seconds"])
            ratio = f"{row['per_user_tok_s'] / plain[row['concurrency']]:.2f}x" if row["concurrency"] in plain else "-"
            drafting = (f"{row['steps_without_drafting']:.0%} | {row['mean_draft_depth']:.2f} | {row['drafting_ms_per_step']:.1f}"
                        if "mean_draft_depth" in row else "- | - | -")
            lines.append(
                f"| {name} | {row['concurrency']} | {row['throughput_tok_s']:.1f} | {row['per_user_tok_s']:.2f} "
                f"({slowest:.2f}-{fastest:.2f}) | {ratio} | {row['accepted_length']:.2f} | {row['verified_drafts_per_step']:.2f} | {drafting} |"
            )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, rows in results.items():
        ax.plot([r["per_user_tok_s"] for r in rows], [r["throughput_tok_s"] for r in rows], "o-", label=name)
        for r in rows:
            ax.annotate(f"R={r['concurrency']}", (r["per_user_tok_s"], r["throughput_tok_s"]), fontsize=7)
    ax.set(xlabel="per-user tokens/s", ylabel="system tokens/s", title="throughput / interactivity (CPU, SmolLM2)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: the converted SmolLM2 checkpoint")
    parser.add_argument("--drafter", default=str(REPO / "examples" / "drafters" / "smollm2-dspark-b7"))
    parser.add_argument("--reduced-drafter", default=None, help="the same drafter with a reduced vocabulary")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="waves per concurrency; the median is reported")
    parser.add_argument("--only", nargs="+", default=None, help="run only these configurations")
    parser.add_argument("--sps-profile", default=None, help="SPS profile JSON (default: ENVIRONMENT.md table)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_frontier")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_dspark.scheduling.profiles import hardware_name
    from vllm_dspark.scheduling import SpsCurve
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or str(smollm2_checkpoint())
    sps = [list(p) for p in SpsCurve.load(args.sps_profile).points] if args.sps_profile else DEFAULT_SPS
    configs = configurations(args.drafter, args.k, sps, args.reduced_drafter)
    results = {}
    for name, settings in configs.items():
        if args.only and name not in args.only:
            continue
        print(f"{name}:", flush=True)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            results[name] = pool.apply(
                run_configuration, (target, settings, args.concurrency, args.max_tokens, args.repeats)
            )
    meta = {
        "target": target,
        "drafter": args.drafter,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "sps": sps,
        "reduced_drafter": args.reduced_drafter,
        "reduced_vocab": (json.loads((Path(args.reduced_drafter) / "config.json").read_text())["draft_vocab_size"]
                          if args.reduced_drafter else None),
        "hardware": hardware_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    write_results(results, meta, args.out)
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
