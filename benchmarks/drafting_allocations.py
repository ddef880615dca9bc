"""How much the sequential stage's per-step allocations could cost: issue 11's "no per-step
allocations" lever, bounded by measurement instead of built blind.

For the committed drafter's heads (Markov, confidence, reduced LM head), the sequential
stage the proposer runs (`sequential_draft` with the LM head computed row by row, greedy,
every position drafted: the most it allocates) is run at R requests under
`torch.profiler` with memory profiling; every allocator event is counted with its size.
Beside it: the stage's own time and the time of allocating the same tensors alone
(`torch.empty` of each recorded size, in order). The second is what preallocated
buffers could save at most. Writes benchmarks/results/drafting_allocations.{json,md}.

    .venv/bin/python benchmarks/drafting_allocations.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.heads import sequential_draft
from vllm_dspark.targets.smollm2 import smollm2_checkpoint

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "examples/drafters/smollm2-dspark-b7"
OUT = REPO / "benchmarks/results/drafting_allocations"


def stage(drafter: DSparkDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
    """One drafting step's sequential stage as the proposer runs it on a CPU."""
    return sequential_draft(
        drafter.markov_head, drafter.confidence_head,
        drafter.confidence_temperatures(hidden.shape[1], hidden),
        lambda rows, j: drafter.lm_head(hidden[rows, j]), hidden, anchors,
        draft_to_target=drafter.draft_to_target(), target_vocab=drafter.config.vocab_size,
    )


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def allocation_sizes(fn) -> list[int]:
    """Bytes of every CPU allocation `fn` makes. The profiler books an allocation on the
    op that makes it and reports each release as a `[memory]` event of negative size, so
    the temporaries of a step are its releases; the few blocks still alive at its end
    (the outputs) are its positive `[memory]` events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [abs(e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage != 0]


def measure(drafter: DSparkDrafter, requests: int, repeats: int) -> dict:
    k, d = drafter.config.block_size, drafter.config.hidden_size
    generator = torch.Generator().manual_seed(requests)
    hidden = torch.randn(requests, k, d, generator=generator)
    anchors = torch.randint(0, drafter.config.vocab_size, (requests,), generator=generator)
    run = lambda: stage(drafter, hidden, anchors)  # noqa: E731
    for _ in range(5):
        run()
    sizes = allocation_sizes(run)
    alloc_only = lambda: [torch.empty(size, dtype=torch.uint8) for size in sizes]  # noqa: E731
    return {
        "requests": requests,
        "positions": k,
        "allocations": len(sizes),
        "allocated_bytes": sum(sizes),
        "stage_ms": median_ms(run, repeats),
        "allocations_alone_ms": median_ms(alloc_only, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafter = DSparkDrafter.from_pretrained(DRAFTER, smollm2_checkpoint()).eval()
    with torch.no_grad():
        rows = [measure(drafter, r, args.repeats) for r in args.requests]
    meta = {"drafter": str(DRAFTER.relative_to(REPO)), "threads": args.threads, "cpu": platform.processor() or platform.machine(),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    OUT.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Allocations of the sequential stage (CPU)",
        "",
        f"Drafter `{meta['drafter']}` (reduced vocabulary), greedy, every one of the K positions drafted "
        f"(adaptive depth drafts fewer), {args.threads} threads, median of {args.repeats}; measured {meta['measured']}. "
        "`allocations alone` re-allocates the recorded sizes in order: the most that preallocated buffers could save.",
        "",
        "| R | positions | allocations per step | bytes per step | stage ms | allocations alone ms | share of the stage |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        share = row["allocations_alone_ms"] / row["stage_ms"]
        lines.append(f"| {row['requests']} | {row['positions']} | {row['allocations']} | {row['allocated_bytes']:,} | "
                     f"{row['stage_ms']:.2f} | {row['allocations_alone_ms']:.3f} | {share:.1%} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
