"""Where a speculative step's time goes, per stage, in the real engine (CPU).

For each configuration and concurrency R, one wave of R chat prompts (greedy, fixed output
length) runs under cProfile in a fresh engine process, after a warm-up wave; the stages are
read from the profile as milliseconds per engine step:

    target forward       the target's pass (verification included)
    drafter backbone     the drafter's forward pass over the query block
    context K/V          target states -> the drafter's context cache (runs every step)
    LM head              draft logits (only the positions and requests still drafting)
    Markov bias          W1 lookup + W2 bias
    confidence           the confidence head
    sampling etc.        the rest of the sequential stage (argmax / Gumbel, bookkeeping)
    host copies          drafts and confidences to the host
    drafting total       the proposer, all of the above but the target forward
    rejection sampler, scheduler (vLLM's and the plugin's)

cProfile slows Python-heavy code a little; compare rows within one run. The plain decode
step (no speculation) of the same run gives the ratio the drafting-cost goal is stated in.
Writes benchmarks/results/drafting_breakdown.{json,md}.

    git archive be23e44 examples/drafters/smollm2-dspark-b7 | tar -x -C runs/previous   # full vocabulary
    python benchmarks/drafting_breakdown.py --full-vocab-drafter runs/previous/examples/drafters/smollm2-dspark-b7
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# (file suffix, function name) per stage; the outermost match (largest cumulative time).
STAGES: dict[str, list[tuple[str, str]]] = {
    "target forward": [("gpu_model_runner.py", "_model_forward")],
    "drafter backbone": [("qwen3_dflash.py", "forward")],
    "context K/V": [("qwen3_dflash.py", "combine_hidden_states"), ("qwen3_dflash.py", "precompute_and_store_context_kv")],
    "LM head": [("draft_model.py", "draft_logits")],
    "Markov bias": [("heads.py", "step")],
    "confidence": [("heads.py", "logit")],
    "sequential stage": [("heads.py", "sequential_draft")],
    "host copies": [("proposer.py", "take_confidences"), ("gpu_model_runner.py", "_copy_draft_token_ids_to_cpu")],
    "drafting total": [("proposer.py", "propose")],
    "rejection sampler": [("rejection_sampler.py", "forward")],
    "scheduler": [("core/sched/scheduler.py", "schedule"), ("core/sched/scheduler.py", "update_from_output")],
}
STEP = ("gpu_model_runner.py", "execute_model")


# Rows of this report: (label, which drafter, configuration of serve_frontier.py; one home
# for the settings). "full" is a full-vocabulary drafter (`--full-vocab-drafter`), where the
# drafting-cost work started; "served" is the committed drafter with its reduced vocabulary.
ROWS: list[tuple[str, str, str]] = [
    ("no-spec", "served", "no-spec"),
    ("never drafting (fixed k=0): the speculative path's floor", "served", "never drafting (fixed k=0)"),
    ("never drafting, plain steps as before (context every step, rejection sampler)", "served",
     "never drafting, plain steps as before"),
    ("full vocabulary, drafting all K (where it started)", "full", "dspark, drafting all K"),
    ("full vocabulary, adaptive drafting", "full", "dspark"),
    ("{vocab}-word vocabulary, drafting all K", "served", "dspark, drafting all K"),
    ("{vocab}-word vocabulary, adaptive drafting (served)", "served", "dspark"),
    ("{vocab}-word vocabulary, fixed k=1", "served", "fixed-k1 (MTP-1-like)"),
]


def configurations(served: str, full: str | None, k: int) -> dict[str, dict]:
    """The report's rows with their engine settings (full-vocabulary rows only with `full`)."""
    from serve_frontier import configurations as frontier_configurations  # benchmarks/ is the script directory

    drafters = {"served": served} | ({} if full is None else {"full": full})
    available = {which: frontier_configurations(path, k) for which, path in drafters.items()}
    vocab = json.loads((Path(served) / "config.json").read_text()).get("draft_vocab_size") or "full"
    return {label.format(vocab=vocab): available[which][name] for label, which, name in ROWS if which in available}


def cumulative_ms(stats: pstats.Stats, targets: list[tuple[str, str]]) -> float:
    """Sum over targets of the outermost matching function's cumulative seconds, in ms."""
    total = 0.0
    for suffix, name in targets:
        times = [value[3] for (file, _, func), value in stats.stats.items() if func == name and file.endswith(suffix)]
        total += max(times, default=0.0)
    return 1000.0 * total


def profile_configuration(target: str, settings: dict, concurrency: int, max_tokens: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from serve_frontier import engine_kwargs, eval_prompts  # benchmarks/ is the script directory

    llm = LLM(model=target, **engine_kwargs(max(concurrency, 1)), **settings)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = eval_prompts(concurrency)
    llm.chat(prompts, params, use_tqdm=False)  # warm-up: the plugin learns its costs here
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.chat(prompts, params, use_tqdm=False)
    profiler.disable()
    wave = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    steps = max(1, sum(v[0] for (f, _, n), v in stats.stats.items() if n == STEP[1] and f.endswith(STEP[0])))
    row = {name: cumulative_ms(stats, targets) / steps for name, targets in STAGES.items()}
    row["sampling etc."] = row["sequential stage"] - row["LM head"] - row["Markov bias"] - row["confidence"]
    row["step"] = 1000.0 * wave / steps
    row["steps"] = steps
    row["per_user_tok_s"] = max_tokens / wave
    return row


def write(results: dict, meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    columns = ["step", "target forward", "drafting total", "drafter backbone", "context K/V", "LM head",
               "Markov bias", "confidence", "sampling etc.", "host copies", "rejection sampler", "scheduler"]
    lines = [
        "# Drafting breakdown (real engine under cProfile, CPU)", "",
        f"Target {meta['target']}, K = {meta['k']}, {meta['max_tokens']} greedy tokens per request, one profiled "
        f"wave after a warm-up wave; milliseconds per engine step. Measured {meta['date']} on {meta['hardware']}. "
        "`drafting / plain step` is the drafting total over the no-speculation step of the same R.", "",
    ]
    for r, rows in results.items():
        plain = rows.get("no-spec", {}).get("step")
        lines += [f"## R = {r}", "",
                  "| configuration | per-user tok/s | " + " | ".join(columns) + " | drafting / plain step |",
                  "|---|---|" + "---|" * len(columns) + "---|"]
        for name, row in rows.items():
            ratio = f"{row['drafting total'] / plain:.0%}" if plain and name != "no-spec" else "-"
            lines.append(f"| {name} | {row['per_user_tok_s']:.2f} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + f" | {ratio} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None, help="default: the converted SmolLM2 checkpoint")
    parser.add_argument("--drafter", default=str(REPO / "examples" / "drafters" / "smollm2-dspark-b7"))
    parser.add_argument("--full-vocab-drafter", default=None,
                        help="a full-vocabulary drafter for the LM-head rows (e.g. the previous committed one)")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS / "drafting_breakdown")
    args = parser.parse_args()

    from vllm_dspark.scheduling.profiles import hardware_name
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or str(smollm2_checkpoint())
    results: dict[str, dict[str, dict]] = {}
    for r in args.concurrency:
        results[str(r)] = {}
        for name, settings in configurations(args.drafter, args.full_vocab_drafter, args.k).items():
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                row = pool.apply(profile_configuration, (target, settings, r, args.max_tokens))
            results[str(r)][name] = row
            print(f"R={r} {name}: step {row['step']:.1f} ms, drafting {row['drafting total']:.1f} ms", flush=True)
    meta = {"target": target, "drafter": args.drafter, "full_vocab_drafter": args.full_vocab_drafter, "k": args.k,
            "max_tokens": args.max_tokens, "hardware": hardware_name(), "date": time.strftime("%Y-%m-%d %H:%M")}
    write(results, meta, args.out)
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
