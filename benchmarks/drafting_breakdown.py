"""Where a speculative step's time goes, per stage, in the real engine (CPU).

For each configuration and concurrency R, one wave of R prompts (greedy, fixed output
length; `--prompts`, mixed by default) runs under cProfile in a fresh engine process, after
a warm-up wave; with `--requests-per-user` above 1 a closed-loop turn as `serve_frontier.py`
serves it instead (steps that draft nothing then queue their context, and prompts arrive
between decoding steps). The stages are read from the profile as milliseconds per engine
step:

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
Below each R's rows, one row per lever of the drafting-cost issue: what a built lever saved
between two rows, and what a lever not built could save at most (the measured time of the
work it would remove; the allocation bound comes from drafting_allocations.json).
Writes benchmarks/results/drafting_breakdown.{json,md}.

    git archive be23e44 examples/drafters/smollm2-dspark-b7 | tar -x -C runs/previous   # full vocabulary
    python benchmarks/drafting_breakdown.py --full-vocab-drafter runs/previous/examples/drafters/smollm2-dspark-b7
    python benchmarks/drafting_breakdown.py --concurrency 16 --prompts code --requests-per-user 3 --max-tokens 64 \
        --only "4096-word vocabulary, dspark + n-gram (the default)" \
        "4096-word vocabulary, dspark + n-gram, context projection in float32" \
        --out benchmarks/results/context_projection/closed_loop_breakdown
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
ALLOCATIONS = RESULTS / "drafting_allocations.json"  # the allocation lever's bound (drafting_allocations.py)
# (file suffix, function name) per stage; the outermost match (largest cumulative time).
STAGES: dict[str, list[tuple[str, str]]] = {
    "target forward": [("gpu_model_runner.py", "_model_forward")],
    "drafter backbone": [("qwen3_dflash.py", "forward")],
    "context K/V": [("draft_model.py", "combine_hidden_states"), ("qwen3_dflash.py", "precompute_and_store_context_kv")],
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
FLOOR = "never drafting (fixed k=0): the speculative path's floor"
FLOOR_BEFORE = "never drafting, plain steps as before (context every step, rejection sampler)"
FULL_ALL_K = "full vocabulary, drafting all K (where it started)"
FULL_ADAPTIVE = "full vocabulary, adaptive drafting"
REDUCED_ALL_K = "{vocab}-word vocabulary, drafting all K"
SERVED = "{vocab}-word vocabulary, adaptive drafting (served)"
REDUCED_ALL_K_FLOAT32_CONTEXT = "{vocab}-word vocabulary, drafting all K, context projection in float32"
HYBRID = "{vocab}-word vocabulary, dspark + n-gram (the default)"
HYBRID_FLOAT32_CONTEXT = "{vocab}-word vocabulary, dspark + n-gram, context projection in float32"
ROWS: list[tuple[str, str, str]] = [
    ("no-spec", "served", "no-spec"),
    (FLOOR, "served", "never drafting (fixed k=0)"),
    (FLOOR_BEFORE, "served", "never drafting, plain steps as before"),
    (FULL_ALL_K, "full", "dspark, drafting all K"),
    (FULL_ADAPTIVE, "full", "dspark"),
    (REDUCED_ALL_K, "served", "dspark, drafting all K"),
    (REDUCED_ALL_K_FLOAT32_CONTEXT, "served", "dspark, drafting all K, context projection in float32"),
    (SERVED, "served", "dspark"),
    ("{vocab}-word vocabulary, fixed k=1", "served", "fixed-k1 (MTP-1-like)"),
    (HYBRID, "served", "dspark + n-gram"),
    (HYBRID_FLOAT32_CONTEXT, "served", "dspark + n-gram, context projection in float32"),
]


def draft_vocab_label(drafter: str) -> str:
    """The drafter's draft-vocabulary size as the row labels name it ("full" without one)."""
    return str(json.loads((Path(drafter) / "config.json").read_text()).get("draft_vocab_size") or "full")


def configurations(served: str, full: str | None, k: int) -> dict[str, dict]:
    """The report's rows with their engine settings (full-vocabulary rows only with `full`)."""
    from serve_frontier import configurations as frontier_configurations  # benchmarks/ is the script directory

    drafters = {"served": served} | ({} if full is None else {"full": full})
    available = {which: frontier_configurations(path, k) for which, path in drafters.items()}
    vocab = draft_vocab_label(served)
    return {label.format(vocab=vocab): available[which][name] for label, which, name in ROWS if which in available}


def cumulative_ms(stats: pstats.Stats, targets: list[tuple[str, str]]) -> float:
    """Sum over targets of the outermost matching function's cumulative seconds, in ms."""
    total = 0.0
    for suffix, name in targets:
        times = [value[3] for (file, _, func), value in stats.stats.items() if func == name and file.endswith(suffix)]
        total += max(times, default=0.0)
    return 1000.0 * total


def profile_configuration(target: str, settings: dict, concurrency: int, max_tokens: int, prompt_set: str = "mixed",
                          requests_per_user: int = 1) -> dict:
    """One configuration's stages per engine step over a profiled turn after a warm-up
    turn: a wave of `concurrency` prompts, or with `requests_per_user` > 1 a closed loop
    as `serve_frontier.py` serves it (output lengths spread, each finished request
    replaced at once), where steps that draft nothing queue their context and prompts
    arrive between decoding steps."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from serve_frontier import engine_kwargs, eval_prompts, output_lengths, serve_turn  # benchmarks/ is the script directory

    llm = LLM(model=target, **engine_kwargs(max(concurrency, 1)), **settings)
    count = concurrency * requests_per_user

    def turn(offset: int) -> dict:
        lengths = output_lengths(max_tokens, count, offset, varied=requests_per_user > 1)
        requests = [(prompt, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
                    for prompt, length in zip(eval_prompts(count, prompt_set, offset), lengths)]
        return serve_turn(llm, requests, concurrency)

    turn(0)  # warm-up: the plugin learns its costs here
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    served = turn(count if requests_per_user > 1 else 0)
    profiler.disable()
    wave = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    steps = max(1, sum(v[0] for (f, _, n), v in stats.stats.items() if n == STEP[1] and f.endswith(STEP[0])))
    row = {name: cumulative_ms(stats, targets) / steps for name, targets in STAGES.items()}
    row["sampling etc."] = row["sequential stage"] - row["LM head"] - row["Markov bias"] - row["confidence"]
    row["step"] = 1000.0 * wave / steps
    row["steps"] = steps
    row["per_user_tok_s"] = served["median_user_tok_s"] if requests_per_user > 1 else max_tokens / wave
    return row


def lever_rows(rows: dict[str, dict], vocab: str, allocations_ms: float | None) -> list[str]:
    """One row per lever of issue 11 at one R, read off this run's rows: what was built and
    what it saved, or, for a lever not built, the most it could save (the time of exactly the
    work it would remove)."""
    full_all, full_adaptive = rows.get(FULL_ALL_K), rows.get(FULL_ADAPTIVE)
    all_k, served = rows.get(REDUCED_ALL_K.format(vocab=vocab)), rows.get(SERVED.format(vocab=vocab))
    floor, before = rows.get(FLOOR), rows.get(FLOOR_BEFORE)
    lines = []
    if full_all and all_k:
        lines.append(f"| reduced draft vocabulary ({vocab} words) | built | LM head {full_all['LM head']:.1f} -> {all_k['LM head']:.1f} ms, "
                     f"drafting {full_all['drafting total']:.1f} -> {all_k['drafting total']:.1f} ms (all K drafted) |")
    if all_k and served:
        lines.append(f"| whether and how deep to draft (adaptive drafting, early stop) | built | drafting {all_k['drafting total']:.1f} -> "
                     f"{served['drafting total']:.1f} ms per step (full vocabulary: "
                     + (f"{full_all['drafting total']:.1f} -> {full_adaptive['drafting total']:.1f} ms" if full_all and full_adaptive else "not run")
                     + ") |")
    if floor and before:
        lines.append(f"| steps that draft nothing run as plain ones (deferred context, no rejection sampler) | built | "
                     f"step {before['step']:.1f} -> {floor['step']:.1f} ms, context K/V {before['context K/V']:.1f} -> {floor['context K/V']:.1f} ms, "
                     f"rejection sampler {before['rejection sampler']:.1f} -> {floor['rejection sampler']:.1f} ms |")
    pairs = [(REDUCED_ALL_K_FLOAT32_CONTEXT, REDUCED_ALL_K, "all K drafted"), (HYBRID_FLOAT32_CONTEXT, HYBRID, "the default hybrid")]
    for before_label, after_label, which in pairs:
        float32_context, bfloat16_context = rows.get(before_label.format(vocab=vocab)), rows.get(after_label.format(vocab=vocab))
        if float32_context and bfloat16_context:
            lines.append(f"| the context projection (`fc`) in bfloat16 (`context_projection`, auto) | built | context K/V "
                         f"{float32_context['context K/V']:.2f} -> {bfloat16_context['context K/V']:.2f} ms, drafting "
                         f"{float32_context['drafting total']:.2f} -> {bfloat16_context['drafting total']:.2f} ms, step "
                         f"{float32_context['step']:.1f} -> {bfloat16_context['step']:.1f} ms ({which}) |")
    if served and all_k:
        lines.append(f"| Markov bias on the top-k of the base logits only | not built | at most its whole bias: {served['Markov bias']:.2f} ms "
                     f"served, {all_k['Markov bias']:.2f} ms with all K drafted |")
    if served:
        lines.append(f"| no Python loops over requests | built (the stage loops over positions only) | sequential stage's bookkeeping "
                     f"(`sampling etc.`) {served['sampling etc.']:.2f} ms served |")
    if allocations_ms is not None:
        lines.append(f"| no per-step allocations (preallocated buffers) | not built | at most {allocations_ms:.2f} ms: the stage's allocations "
                     "alone, all K drafted (`drafting_allocations.md`) |")
    return lines


def turn_description(meta: dict) -> str:
    """How the profiled turn served its requests, for the report's header."""
    per_user = meta.get("requests_per_user", 1)
    if per_user == 1:
        return f"{meta['max_tokens']} greedy tokens per request, one profiled wave after a warm-up wave"
    return (f"greedy, a closed loop of R users with {per_user} requests each (output lengths spread over half to 1.5 times "
            f"{meta['max_tokens']} tokens, as in `serve_frontier.py`), one profiled turn after a warm-up turn; per-user tok/s "
            "is the median request's tokens over its end-to-end time")


def write(results: dict, meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    allocations = {row["requests"]: row["allocations_alone_ms"]
                   for row in json.loads(ALLOCATIONS.read_text())["rows"]} if ALLOCATIONS.exists() else {}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    columns = ["step", "target forward", "drafting total", "drafter backbone", "context K/V", "LM head",
               "Markov bias", "confidence", "sampling etc.", "host copies", "rejection sampler", "scheduler"]
    lines = [
        "# Drafting breakdown (real engine under cProfile, CPU)", "",
        f"Target {meta['target']}, K = {meta['k']}, {meta['prompts']} prompts, {turn_description(meta)}; milliseconds "
        f"per engine step. Measured {meta['date']} on {meta['hardware']}. "
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
        lines += ["", f"Levers at R = {r} (milliseconds per engine step, from the rows above):", "",
                  "| lever | state | measured |", "|---|---|---|", *lever_rows(rows, meta["vocab"], allocations.get(int(r))), ""]
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
    parser.add_argument("--prompts", default="mixed", help="eval prompt set (serve_frontier.py's --prompts)")
    parser.add_argument("--requests-per-user", type=int, default=1,
                        help="1: a wave of R prompts; more: a closed loop of R users, this many requests each")
    parser.add_argument("--only", nargs="+", default=None, help="run only these rows (labels as in the report)")
    parser.add_argument("--out", type=Path, default=RESULTS / "drafting_breakdown")
    args = parser.parse_args()

    from vllm_dspark.scheduling.profiles import hardware_name
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or str(smollm2_checkpoint())
    results: dict[str, dict[str, dict]] = {}
    plan = {name: settings for name, settings in configurations(args.drafter, args.full_vocab_drafter, args.k).items()
            if not args.only or name in args.only}
    for r in args.concurrency:
        results[str(r)] = {}
        for name, settings in plan.items():
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                row = pool.apply(profile_configuration, (target, settings, r, args.max_tokens, args.prompts, args.requests_per_user))
            results[str(r)][name] = row
            print(f"R={r} {name}: step {row['step']:.1f} ms, drafting {row['drafting total']:.1f} ms", flush=True)
    meta = {"target": target, "drafter": args.drafter, "full_vocab_drafter": args.full_vocab_drafter, "k": args.k, "vocab": draft_vocab_label(args.drafter),
            "max_tokens": args.max_tokens, "prompts": args.prompts, "requests_per_user": args.requests_per_user,
            "hardware": hardware_name(), "date": time.strftime("%Y-%m-%d %H:%M")}
    write(results, meta, args.out)
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
