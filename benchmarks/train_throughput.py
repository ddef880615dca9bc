"""Drafter training throughput on the CPU: supervised positions per second and per
CPU-second of one training step (packing, teacher-forced pass, losses, backward, AdamW),
as `vllm-dspark train` takes it, on SmolLM2 features of the committed corpus.

    python benchmarks/train_throughput.py --label "top-k labels"
    python benchmarks/train_throughput.py --label "top-k, 8192-word draft vocabulary" --draft-vocab-size 8192 --append
    python benchmarks/train_throughput.py --label "... bf16 autocast" --draft-vocab-size 4096 --bf16 --append
    # the same script against another checkout (e.g. the code before a change):
    PYTHONPATH=/tmp/before python benchmarks/train_throughput.py --label "before" --append

Each run measures one code tree (whatever `vllm_dspark` imports) at each `--threads`;
`--append` adds its rows to the committed results, so trees are compared in one table
(run them back to back: the machine is shared). The script uses only interfaces both the
old and the new feature formats have (`OnTheFlyFeatures`, `pack_batch`, `DrafterLoss`).
It also reports how much of the target's probability mass the top k tokens keep (the TV
loss's error bound, losses.py), when the code tree has soft labels.

Writes benchmarks/results/train_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "train_throughput"
CORPUS = REPO / "examples" / "drafters" / "corpus" / "smollm2-generated.jsonl.xz"


def load_sequences(target: Path, data: Path, layer_ids: list[int], count: int, max_seq_len: int) -> list:
    """The first `count` training-split sequences, target features computed once."""
    from vllm_dspark.training.features import OnTheFlyFeatures

    source = OnTheFlyFeatures(target, data, layer_ids, max_seq_len, heldout_frac=0.05)
    return [source.get(i) for i in range(min(count, len(source)))]


def topk_coverage(target: Path, sequences: list, ks: list[int]) -> dict[int, float] | None:
    """Mean target mass kept by the top k at response positions (None: no soft labels here)."""
    try:
        from vllm_dspark.training.soft_labels import coverage
    except ImportError:
        return None
    from vllm_dspark.training.features import load_target

    model = load_target(target)
    kept: dict[int, list[float]] = {k: [] for k in ks}
    with torch.no_grad():
        for seq in sequences:
            logits = model(seq.input_ids.unsqueeze(0)).logits[0, seq.response_start - 1 : -1]
            for k, value in coverage(logits, ks).items():
                kept[k].append(value)
    return {k: statistics.fmean(v) for k, v in kept.items()}


def reduced(drafter, target: Path, corpus: Path, size: int):
    """The same drafter with a reduced draft vocabulary picked from the corpus."""
    import tempfile

    from vllm_dspark.model.drafter import DSparkDrafter
    from vllm_dspark.model.reduce_vocab import reduce_with_report

    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(Path(tmp) / "full")
        reduce_with_report(Path(tmp) / "full", target, corpus, size, Path(tmp) / "reduced")
        return DSparkDrafter.from_pretrained(Path(tmp) / "reduced", target)


def time_steps(drafter, sequences: list, steps: int, batch_seqs: int, anchors: int, threads: int, bf16: bool) -> dict:
    """Median and spread of positions per (CPU-)second over `steps` timed steps after one
    warm-up step; sequences are taken round-robin, anchors with a fixed generator."""
    from vllm_dspark.training.blocks import DrafterLoss, pack_batch

    torch.set_num_threads(threads)
    model = DrafterLoss(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    k = drafter.config.block_size
    wall, cpu = [], []
    for step in range(steps + 1):
        picked = [sequences[(step * batch_seqs + i) % len(sequences)] for i in range(batch_seqs)]
        t0, c0 = time.perf_counter(), time.process_time()
        batch = pack_batch(picked, anchors, k, torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as `train --precision bf16`
            losses = model(batch)
        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        positions = batch.num_blocks * k
        if step:  # the first step warms up allocators and caches
            wall.append(positions / (time.perf_counter() - t0))
            cpu.append(positions / (time.process_time() - c0))
    return {
        "threads": threads,
        "positions_per_s": statistics.median(wall),
        "positions_per_cpu_s": statistics.median(cpu),
        "spread_per_s": [min(wall), max(wall)],
        "steps": steps,
        "positions_per_step": positions,
    }


def markdown(rows: list[dict], coverage_rows: dict[str, dict]) -> str:
    lines = [
        "# Drafter training throughput (CPU)",
        "",
        "One training step as `vllm-dspark train` takes it (packing, teacher-forced pass, losses,",
        "backward, AdamW), SmolLM2-135M target, default drafter (block 7), median over the timed",
        "steps (spread: min-max of positions/s). `python benchmarks/train_throughput.py`.",
        "",
        "| code | threads | positions/s | positions per CPU-second | vs the first row, per CPU-second | spread (positions/s) |",
        "|---|---|---|---|---|---|",
    ]
    base = rows[0]["positions_per_cpu_s"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['threads']} | {r['positions_per_s']:.0f} | {r['positions_per_cpu_s']:.0f} | "
                     f"{r['positions_per_cpu_s'] / base:.2f}x | {r['spread_per_s'][0]:.0f}-{r['spread_per_s'][1]:.0f} |")
    # The mass kept depends on the data, not on the code measured: one table per distinct result.
    distinct: dict[tuple, list[str]] = {}
    for label, kept in coverage_rows.items():
        distinct.setdefault(tuple(sorted(kept.items(), key=lambda item: int(item[0]))), []).append(label)
    for kept, labels in distinct.items():
        lines += ["", f"Target mass kept by the top k soft labels (mean over response positions; measured with: "
                  f"{'; '.join(labels)}):", "",
                  "| k | " + " | ".join(str(k) for k, _ in kept) + " |", "|---|" + "---|" * len(kept),
                  "| mass kept | " + " | ".join(f"{v:.4f}" for _, v in kept) + " |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="name of the code tree measured")
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=CORPUS)
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-seqs", type=int, default=4)
    parser.add_argument("--anchors-per-seq", type=int, default=32)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="train a reduced draft vocabulary of this size")
    parser.add_argument("--bf16", action="store_true", help="the forward pass under bf16 autocast (train --precision bf16)")
    parser.add_argument("--append", action="store_true", help="add to the committed rows instead of replacing them")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from vllm_dspark.model.drafter import DSparkDrafter
    from vllm_dspark.model.init_drafter import drafter_config_for_target, init_weights

    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or smollm2_checkpoint()
    config = drafter_config_for_target(target)
    sequences = load_sequences(target, args.data, config.target_layer_ids, args.sequences, args.max_seq_len)
    initial = DSparkDrafter(config)
    init_weights(initial, 0)
    initial.load_shared_from_target(target)
    if args.draft_vocab_size:
        initial = reduced(initial, target, args.data, args.draft_vocab_size)
    rows = []
    for threads in args.threads:
        drafter = copy.deepcopy(initial)  # every thread count starts from the same weights
        row = {"label": args.label, **time_steps(drafter, sequences, args.steps, args.batch_seqs, args.anchors_per_seq, threads,
                                                     args.bf16)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    kept = topk_coverage(target, sequences[:8], [1, 4, 16, 64, 256])
    json_path = args.out.with_suffix(".json")
    previous = json.loads(json_path.read_text()) if args.append and json_path.is_file() else {"rows": [], "coverage": {}}
    result = {
        "rows": [r for r in previous["rows"] if r["label"] != args.label] + rows,
        "coverage": {**previous["coverage"], **({args.label: kept} if kept else {})},
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result["rows"], result["coverage"]))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
