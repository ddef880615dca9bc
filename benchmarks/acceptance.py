"""Offline accepted length (tau) of two drafters on math, code and chat, at temperature 0
and 1: the project's counterpart of DSPARK.md section 5 (the paper's tau table and its
Figure 2, conditional acceptance by position).

Every (drafter, dataset, temperature) cell runs `vllm_dspark.evaluation.evaluate` (chain
drafting, fixed K, exact rejection sampling) on the first N prompts of
vllm_dspark/evaluation/prompts/{gsm8k,humaneval,mt-bench}.jsonl (`default_eval_dir()`) and
is stored as its own JSON file, so an interrupted run resumes where it stopped; a cell is
redone only when its settings (the dataset path included) or the drafter's weights changed.
Outputs under --out-dir (default benchmarks/results/):
  acceptance.json, acceptance.md          tau per dataset, macro average, first/second ratio
  acceptance_by_position.png              conditional acceptance (solid) and mean c_k (dashed)
  acceptance_reliability_<drafter>.png    copy of the drafter's calibration diagram, if any
  acceptance_cells/<drafter>_<dataset>_T<temp>.json
  traces/acceptance_<drafter>_<dataset>_T<temp>.jsonl   rounds for the scheduling simulator

Usage: python benchmarks/acceptance.py [--drafter NAME=DIR ...] [--num-prompts N]
       [--max-new-tokens M] [--jobs J] [--out-dir DIR]
The default size (10 prompts per dataset, 96 new tokens per turn, 12 cells) takes about
20-40 minutes on this project's busy 2-core CPU machine (one torch thread).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import math
import multiprocessing
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_dspark.evaluation.dataset import default_eval_dir
from vllm_dspark.evaluation.evaluator import EvalSettings, evaluate

REPO = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "humaneval", "mt-bench")
TEMPERATURES = (0.0, 1.0)
DEFAULT_DRAFTERS = (
    f"dspark={REPO / 'examples/drafters/smollm2-dspark-b7'}",
    f"dflash={REPO / 'examples/drafters/smollm2-dflash-b7'}",
)
# DSPARK.md section 5, Qwen3-8B, gamma 7, temperature 1: DSpark / DFlash tau.
PAPER = {"gsm8k": (6.17, 5.33), "humaneval": (5.52, 4.64), "mt-bench": (3.72, 3.11)}
# A position's conditional acceptance over fewer judged drafts is too noisy to plot or
# average (it is still listed, marked, in the tables).
MIN_JUDGED = 20
# Per-cell fields copied into acceptance.json (the cell files keep everything).
CELL_FIELDS = (
    "tau", "tau_stderr", "rounds", "tokens_generated", "acceptance_by_position", "reached_by_position",
    "mean_confidence_by_position", "prefix_survival_by_position",
    "mean_prefix_confidence_by_position", "prefix_confidence_ece", "wall_seconds",
)


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """One run per output directory: two runs would overwrite each other's cells and traces."""
    with lock_path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise SystemExit(f"another acceptance run (pid {handle.read().strip() or '?'}) holds {lock_path}; "
                             "wait for it to finish or pass another --out-dir") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


def parse_drafter(text: str) -> tuple[str, Path]:
    """Absolute paths, so a stored cell is found again whatever the working directory."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, Path(path).resolve()


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def judged(cell: dict, field: str) -> list[float | None]:
    """Per-position values, None where fewer than MIN_JUDGED drafts were judged."""
    return [v if n >= MIN_JUDGED else None for v, n in zip(cell[field], cell["reached_by_position"])]


def fingerprint(drafter: Path) -> str:
    """Hash of the drafter's config and weights: a retrained drafter invalidates its cells."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((drafter / name).read_bytes())
    return digest.hexdigest()[:16]


def cell_name(drafter: str, dataset: str, temperature: float) -> str:
    return f"{drafter}_{dataset}_T{temperature:g}"


def run_cell(settings: EvalSettings, cell_file: Path, trace_file: Path, drafter_hash: str) -> dict:
    """Evaluate one cell unless an identical one is stored; the cell file is written last,
    after its trace, so its presence means the cell is complete."""
    key = {**json.loads(json.dumps(asdict(settings), default=str)), "drafter_sha256": drafter_hash}
    if cell_file.is_file():
        stored = json.loads(cell_file.read_text())
        if stored.get("key") == key:
            print(f"{cell_file.stem}: stored, tau {stored['tau']:.3f}")
            return stored
    partial = trace_file.with_suffix(".partial")
    with partial.open("w") as trace:
        result = evaluate(settings, trace=trace)
    partial.replace(trace_file)
    result["key"] = key
    cell_file.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{cell_file.stem}: tau {result['tau']:.3f} ± {result['tau_stderr'] or 0:.3f}, "
          f"{result['rounds']} rounds, {result['wall_seconds']:.0f} s")
    return result


def macro(cells: dict[str, dict]) -> tuple[float, float]:
    """Mean tau over datasets and its standard error (datasets independent)."""
    taus = [c["tau"] for c in cells.values()]
    errors = [c["tau_stderr"] or 0.0 for c in cells.values()]
    return sum(taus) / len(taus), math.sqrt(sum(e * e for e in errors)) / len(errors)


def ratio(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """a / b with a delta-method error that treats a and b as independent; both use the
    same prompts, so the true error is smaller."""
    r = a[0] / b[0]
    return r, r * math.sqrt((a[1] / a[0]) ** 2 + (b[1] / b[0]) ** 2)


def interval95(value: float, stderr: float, digits: int) -> str:
    return f"[{value - 1.96 * stderr:.{digits}f}, {value + 1.96 * stderr:.{digits}f}]"


def summarise(results: dict[str, dict[str, dict[str, dict]]], names: list[str]) -> dict:
    """results[drafter][temperature][dataset] -> the acceptance.json body."""
    summary: dict = {"cells": {}, "macro_tau": {}, "ratio": {}}
    for name in names:
        for temp, cells in results[name].items():
            summary["cells"].setdefault(name, {})[temp] = {
                ds: {f: cell.get(f) for f in CELL_FIELDS} for ds, cell in cells.items()
            }
            summary["macro_tau"].setdefault(name, {})[temp] = dict(zip(("tau", "stderr"), macro(cells)))
    first, second = names[0], names[1]
    for temp, cells in results[first].items():
        rows = {ds: ratio((c["tau"], c["tau_stderr"] or 0.0), (results[second][temp][ds]["tau"],
                results[second][temp][ds]["tau_stderr"] or 0.0)) for ds, c in cells.items()}
        rows["macro"] = ratio(macro(cells), macro(results[second][temp]))
        summary["ratio"][temp] = {k: {"ratio": v[0], "stderr": v[1]} for k, v in rows.items()}
    summary["ratio_of"] = f"{first} / {second}"
    return summary


def plot_by_position(results: dict, names: list[str], datasets: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(results[names[0]])
    fig, axes = plt.subplots(len(temps), len(datasets), figsize=(4 * len(datasets), 3.3 * len(temps)),
                             squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, temp in enumerate(temps):
        for col, ds in enumerate(datasets):
            ax = axes[row][col]
            for i, name in enumerate(names):
                cell = results[name][temp][ds]
                rates = judged(cell, "acceptance_by_position")
                conf = judged(cell, "mean_confidence_by_position")
                positions = range(1, len(rates) + 1)
                ax.plot(positions, [math.nan if r is None else r for r in rates], "o-", color=colors[i],
                        label=f"{name} acceptance")
                ax.plot(positions, [math.nan if c is None else c for c in conf], "x--", color=colors[i],
                        alpha=0.6, label=f"{name} mean c_k")
            ax.set_title(f"{ds}, T={temp}")
            ax.set_xlabel("draft position k")
            ax.set_xticks(positions)
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=2 * len(names), fontsize=8)
    fig.suptitle(f"Conditional acceptance by draft position (SmolLM2-135M target; positions with < {MIN_JUDGED} "
                 "judged drafts left out)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def position_trends(by_temp: dict[str, dict[str, dict]]) -> dict[str, list[float | None]]:
    """Conditional acceptance per position, averaged over the datasets that reach it
    (MIN_JUDGED times)."""
    trends = {}
    for temp, cells in by_temp.items():
        columns = zip(*(judged(c, "acceptance_by_position") for c in cells.values()))
        trends[temp] = [None if not (v := [x for x in col if x is not None]) else sum(v) / len(v) for col in columns]
    return trends


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_markdown(summary: dict, results: dict, names: list[str], datasets: list[str], args: argparse.Namespace,
                   figures: list[str], out: Path) -> None:
    first, second = names[0], names[1]
    lines = [
        "# Offline accepted length: SmolLM2-135M-Instruct target",
        "",
        f"Produced by `{shlex.join(['python', 'benchmarks/acceptance.py', *args.argv])}` (chain drafting, "
        f"fixed K = {args.block_size or 'block size'}, exact rejection sampling; {args.num_prompts} prompts per "
        f"dataset, {args.max_new_tokens} new tokens per turn, seed {args.seed}). tau counts the bonus token; ± is "
        "the standard error clustered by prompt, [..] the 95% interval (normal approximation; the ratio's treats "
        "the two drafters as independent, which overstates it: both answer the same prompts).",
        "Drafters: " + ", ".join(f"`{n}` = `{shown(p)}`" for n, p in args.drafter) + ".",
        "",
    ]
    for temp in results[first]:
        lines += [f"## Temperature {temp}", "", "| drafter | " + " | ".join(datasets) + " | macro |",
                  "|---" * (len(datasets) + 2) + "|"]
        for name in names:
            cells = results[name][temp]
            m = summary["macro_tau"][name][temp]
            lines.append(f"| {name} | " + " | ".join(
                f"{cells[ds]['tau']:.2f} ± {cells[ds]['tau_stderr'] or 0:.2f}" for ds in datasets
            ) + f" | {m['tau']:.2f} ± {m['stderr']:.2f} {interval95(m['tau'], m['stderr'], 2)} |")
        r = summary["ratio"][temp]
        lines.append(f"| {first}/{second} | " + " | ".join(f"{r[ds]['ratio']:.3f}" for ds in datasets)
                     + f" | **{r['macro']['ratio']:.3f}** ± {r['macro']['stderr']:.3f} "
                     f"{interval95(r['macro']['ratio'], r['macro']['stderr'], 3)} |")
        k = len(results[first][temp][datasets[0]]["acceptance_by_position"])
        lines += ["", "Conditional acceptance by position (mean calibrated c_k over the same rounds in "
                  "brackets) and the ECE of the prefix survival a_k = c_1...c_k:", "",
                  "| drafter | dataset | " + " | ".join(f"k={i + 1}" for i in range(k)) + " | ECE(a_k) |",
                  "|---|---" + "|---" * (k + 1) + "|"]
        for name in names:
            for ds in datasets:
                cell = results[name][temp][ds]
                marks = ["*" if 0 < n < MIN_JUDGED else "" for n in cell["reached_by_position"]]
                lines.append(f"| {name} | {ds} | " + " | ".join(
                    f"{fmt(a)}{m} ({fmt(c)})" for a, m, c in zip(cell["acceptance_by_position"], marks,
                                                                 cell["mean_confidence_by_position"]))
                    + f" | {fmt(cell['prefix_confidence_ece'], 3)} |")
        lines += ["", f"\\* fewer than {MIN_JUDGED} judged drafts: left out of the figure and the averages below.", ""]
    paper = [p[0] / p[1] for p in PAPER.values()]
    seconds = sum(c["wall_seconds"] for temps in results.values() for cells in temps.values() for c in cells.values())
    lines += [
        "## Summary",
        "",
        *(f"- T={temp}: macro {first}/{second} = {r['macro']['ratio']:.3f} ± {r['macro']['stderr']:.3f}, 95% "
          f"{interval95(r['macro']['ratio'], r['macro']['stderr'], 3)}"
          for temp, r in summary["ratio"].items()),
        *(f"- {name}, T={temp}: conditional acceptance by position, mean over datasets: "
          + " ".join(fmt(x) for x in trend)
          for name in names for temp, trend in position_trends(results[name]).items()),
        f"- Evaluation time: {seconds / 60:.0f} min over {sum(len(c) for t in results.values() for c in t.values())} "
        "cells (shared CPU; torch threads as in the command above).",
        "",
        "## Reference",
        "",
        f"The paper (Qwen3-8B, gamma 7, temperature 1, far more training data) reports DSpark/DFlash tau ratios "
        f"of {', '.join(f'{p:.2f}' for p in paper)} on GSM8K, HumanEval and MT-Bench "
        f"(macro over six datasets: 1.184). Target here: macro ratio >= 1.10 at temperature 1.",
        "",
        "Figures: " + ", ".join(f"![{f}]({f})" for f in figures),
        "",
    ]
    out.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", type=parse_drafter, action="append", default=None,
                        help="NAME=DIR, twice (first/second is the reported ratio); "
                        "default: dspark and dflash under examples/drafters/")
    parser.add_argument("--target", type=Path, default=None, help="default: the SmolLM2 checkpoint")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--eval-dir", type=Path, default=default_eval_dir(),
                        help="default: $VLLM_DSPARK_EVAL_DIR or the sets shipped in vllm_dspark/evaluation/prompts")
    parser.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=None, help="K (default: the drafters' block size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cell (see `vllm-dspark eval --help`)")
    parser.add_argument("--jobs", type=int, default=1, help="cells evaluated at once, one process each")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    args.drafter = args.drafter or [parse_drafter(d) for d in DEFAULT_DRAFTERS]
    names = [name for name, _ in args.drafter]
    if len(names) != 2 or names[0] == names[1]:
        parser.error("give exactly two drafters with different names")
    for name, path in args.drafter:
        if not (path / "config.json").is_file():
            parser.error(f"drafter {name}: no config.json in {path}")
    if args.target is None:
        from vllm_dspark.targets.smollm2 import smollm2_checkpoint

        args.target = smollm2_checkpoint()
    torch.set_num_threads(args.threads)

    cell_dir, trace_dir = args.out_dir / "acceptance_cells", args.out_dir / "traces"
    cell_dir.mkdir(parents=True, exist_ok=True)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(cell_dir / ".lock"):
        run_all(args, names, cell_dir, trace_dir)


def run_all(args: argparse.Namespace, names: list[str], cell_dir: Path, trace_dir: Path) -> None:
    start = time.perf_counter()
    results: dict[str, dict[str, dict[str, dict]]] = {}
    cells: dict[tuple[str, str, str], tuple] = {}
    for name, path in args.drafter:
        drafter_hash = fingerprint(path)
        for temp in args.temperatures:
            for ds in args.datasets:
                settings = EvalSettings(
                    target=args.target, drafter=path, dataset=args.eval_dir / f"{ds}.jsonl",
                    num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, temperature=temp,
                    block_size=args.block_size, seed=args.seed,
                )
                cell = cell_name(name, ds, temp)
                cells[name, str(temp), ds] = (settings, cell_dir / f"{cell}.json", trace_dir / f"acceptance_{cell}.jsonl",
                                              drafter_hash)
    # Cells are independent; --jobs runs them in worker processes of --threads threads each.
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=torch.set_num_threads, initargs=(args.threads,)) as pool:
        futures = {where: pool.submit(run_cell, *cell) for where, cell in cells.items()}
        for (name, temp, ds), future in futures.items():
            results.setdefault(name, {}).setdefault(temp, {})[ds] = future.result()

    figures = ["acceptance_by_position.png"]
    plot_by_position(results, names, args.datasets, args.out_dir / figures[0])
    for name, path in args.drafter:
        if (path / "reliability.png").is_file():
            figures.append(f"acceptance_reliability_{name}.png")
            shutil.copyfile(path / "reliability.png", args.out_dir / figures[-1])
    summary = summarise(results, names)
    summary["settings"] = {
        "target": str(args.target), "drafters": {n: str(p) for n, p in args.drafter}, "datasets": args.datasets,
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
        "seed": args.seed, "threads": args.threads, "jobs": args.jobs, "figures": figures,
    }
    (args.out_dir / "acceptance.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_markdown(summary, results, names, args.datasets, args, figures, args.out_dir / "acceptance.md")
    for temp, rows in summary["ratio"].items():
        macro_taus = ", ".join(f"{n} {summary['macro_tau'][n][temp]['tau']:.3f}" for n in names)
        print(f"T={temp}: macro tau {macro_taus}; {summary['ratio_of']} = {rows['macro']['ratio']:.3f}")
    print(f"wrote {args.out_dir / 'acceptance.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
