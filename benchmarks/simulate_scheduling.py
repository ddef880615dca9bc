"""Replay draft-round traces against engine throughput curves, per verification policy.

For every concurrency R in 1..256, R request slots decode in lock step. Each step every slot
takes its request's next recorded draft round (K calibrated conditional confidences and the
number of drafts the target accepted when all K were verified), the policy picks how many
drafts to verify, the slot gains min(accepted, verified) + 1 tokens (chain drafting: a
truncated prefix accepts exactly the tokens the full one accepted up to the cut, plus the
bonus/resampled token), and the step lasts 1 / SPS(B) with B = R + verified drafts. All
policies replay the same rounds in the same order (common random numbers).

Trace format (JSONL, one draft round per line):
    {"confidences": [c_1, ..., c_K], "accepted": a, "request": id}
`request` is optional; rounds of one request must be consecutive; a slot replays one
request's rounds, then moves to the next unused request (wrapping around the trace).
Real traces come from the offline evaluator or the engine (`--trace FILE`); without one a
synthetic trace is generated (see `synthetic_trace` for its assumptions).

Curves: the measured SmolLM2-135M CPU curve of ENVIRONMENT.md (step time extrapolated
linearly beyond B = 128) and a stylised GPU-like curve (see `gpu_like_curve`).

Every step runs through the engine's own `VerificationController` (policy objects, the
dspark_async budget chain, live recalibration): the simulator differs from the engine only
in where the step's inputs come from. Decode-only passes (no prefill tokens in B), all
requests sampled (one recalibrator), steps exactly as long as the curve says (no learned
step-time model).

Live recalibration study: the trace's confidences are distorted the ways a drafter can be
off in serving (biased or too sharp, see `MISCALIBRATIONS`), and `dspark` replays them
with and without the controller's online recalibration.

Outputs under benchmarks/results/: simulate_scheduling.json, .md and .png (Pareto plot of
system tokens/s against per-user tokens/s, one point per concurrency).

Usage: python benchmarks/simulate_scheduling.py [--trace FILE] [--write-trace FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import SpsCurve
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.recalibration import logit, sigmoid

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_STEP_MS = {1: 84, 2: 91, 4: 96, 8: 112, 16: 146, 32: 183, 64: 308, 128: 473}
ROUNDS_PER_POINT = 8000  # draft rounds simulated per (curve, concurrency, policy)
MIN_STEPS = 60
# Distinct markers and dashes: several policies coincide on some curves.
STYLES = {"threshold": ("s", ":"), "dspark": ("o", "-"), "dspark_async": ("^", "--"),
          "sla": ("x", "-."), "sla_tracked": ("+", ":")}
# Distortions of a calibrated trace for the recalibration study: (slope, shift) on the
# confidence logit. The committed SmolLM2 drafter was over-confident in serving.
MISCALIBRATIONS = {"over-confident": (1.0, 1.5), "under-confident": (1.0, -1.5), "too sharp": (2.0, 0.0)}


@dataclass(frozen=True)
class Trace:
    confidences: np.ndarray  # float [M, K]
    accepted: np.ndarray  # int [M], 0..K
    starts: np.ndarray  # int [G], first round of each request
    lengths: np.ndarray  # int [G], rounds of each request

    @property
    def block(self) -> int:
        return self.confidences.shape[1]


def trace_from_rounds(confidences: np.ndarray, accepted: np.ndarray, request: np.ndarray) -> Trace:
    """Group consecutive rounds with the same request id."""
    if confidences.ndim != 2 or len(confidences) == 0:
        raise ValueError("a trace needs at least one round of K confidences")
    if not ((accepted >= 0) & (accepted <= confidences.shape[1])).all():
        raise ValueError("accepted must lie in 0..K")
    boundary = np.flatnonzero(np.r_[True, request[1:] != request[:-1]])
    return Trace(confidences, accepted, boundary, np.diff(np.r_[boundary, len(request)]))


def load_trace(path: Path) -> Trace:
    """Read a JSONL trace; rounds without a request id each count as their own request."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    try:
        confidences = np.array([r["confidences"] for r in records], dtype=np.float64)
        accepted = np.array([r["accepted"] for r in records], dtype=np.int64)
    except (KeyError, ValueError) as error:
        raise ValueError(f"{path}: every line needs K confidences and 'accepted': {error}") from error
    request = np.array([r.get("request", f"#{i}") for i, r in enumerate(records)], dtype=object)
    return trace_from_rounds(confidences, accepted, request)


def synthetic_trace(num_requests: int, block: int, seed: int) -> Trace:
    """Draft rounds of a DSpark-like drafter on a mixed workload. Assumptions:

    - domain mix of the paper's evaluation sets: 40% chat, 30% code, 30% math, with base
      conditional acceptance 0.68 / 0.80 / 0.85 (DSpark tau 3.6-6.2 at gamma 7);
    - per-request latent quality: logit N(0, 0.5) around its domain's base;
    - per-round difficulty shared by the block's positions (easy or hard spans):
      logit N(0, 0.8); per-position noise logit N(0, 0.4); a slight decay of 0.03 logit per
      position (DSpark's acceptance stays nearly flat along the block);
    - acceptance: position k survives with that conditional probability p_k, and the round
      accepts its leading run of survivals;
    - confidence: the calibrated head sees p_k through logit noise N(0, 0.35), i.e. it is
      informative but not an oracle; its calibration error is reported with the results.
    - 20-80 rounds per request.
    """
    rng = np.random.default_rng(seed)
    base = rng.choice(np.log(np.array([0.68, 0.80, 0.85]) / np.array([0.32, 0.20, 0.15])),
                      p=[0.4, 0.3, 0.3], size=num_requests)
    quality = base + rng.normal(0.0, 0.5, num_requests)
    rounds = rng.integers(20, 81, num_requests)
    request = np.repeat(np.arange(num_requests), rounds)
    total = len(request)
    logits = (
        quality[request][:, None]
        + rng.normal(0.0, 0.8, (total, 1))
        + rng.normal(0.0, 0.4, (total, block))
        - 0.03 * np.arange(block)
    )
    survives = rng.random((total, block)) < 1.0 / (1.0 + np.exp(-logits))
    accepted = np.where(survives.all(axis=1), block, np.argmin(survives, axis=1))
    confidences = 1.0 / (1.0 + np.exp(-(logits + rng.normal(0.0, 0.35, logits.shape))))
    return trace_from_rounds(confidences, accepted, request)


def distort(trace: Trace, slope: float, shift: float) -> Trace:
    """The same rounds with confidences sigmoid(slope * logit(c) + shift)."""
    confidences = sigmoid(slope * logit(trace.confidences) + shift)
    return Trace(confidences, trace.accepted, trace.starts, trace.lengths)


def calibration_error(trace: Trace) -> float:
    """Expected calibration error of prefix survival a_k against observed survival (10 bins)."""
    a = np.cumprod(trace.confidences, axis=1).ravel()
    survived = (trace.accepted[:, None] >= np.arange(1, trace.block + 1)).ravel()
    bins = np.minimum((a * 10).astype(int), 9)
    gap = np.abs(np.bincount(bins, a, 10) - np.bincount(bins, survived, 10))
    return float(gap.sum() / len(a))


def cpu_curve() -> SpsCurve:
    return SpsCurve(
        points=[(b, 1000.0 / ms) for b, ms in CPU_STEP_MS.items()],
        metadata={"model": "SmolLM2-135M", "hardware": "2-core x86 CPU", "source": "ENVIRONMENT.md"},
    )


def gpu_like_curve(max_tokens: int = 4096) -> SpsCurve:
    """A stylised decode step of an 8B-class target on one datacenter GPU (not measured).

    step ms = 7.0                      weights streamed once per step (memory-bound floor)
            + 0.002 * B                KV-cache reads, sampling
            + 0.25 * floor((B-1) / 64) kernel tile / CUDA-graph bucket quantisation: a
                                       small cliff after every 64 tokens
            + 0.03 * max(0, B - 256)   compute-bound beyond a knee at 256 tokens
    """
    batch = np.arange(1, max_tokens + 1)
    step_ms = 7.0 + 0.002 * batch + 0.25 * ((batch - 1) // 64) + 0.03 * np.maximum(0, batch - 256)
    return SpsCurve(
        points=list(zip(batch.tolist(), (1000.0 / step_ms).tolist())),
        metadata={"model": "8B-class (stylised)", "hardware": "GPU-like model, not measured"},
    )


def policies(block: int, threshold: float, floor: float) -> dict[str, dict]:
    """Name -> plugin options (as an operator would pass them).

    `sla` applies the floor to every request at every step. `sla_tracked` applies it only
    to requests whose realised speed so far is below it (floor 0 for the others), the way a
    serving integration can use per-request floors to target long-run per-user speed.
    """
    table: dict[str, dict] = {f"fixed_k{k}": {"policy": "fixed", "k": k} for k in range(block + 1)}
    table["threshold"] = {"policy": "threshold", "threshold": threshold}
    table["dspark"] = {"policy": "dspark"}
    table["dspark_async"] = {"policy": "dspark_async"}
    table["sla"] = {"policy": "sla", "min_tokens_per_s": floor}
    table["sla_tracked"] = {"policy": "sla", "min_tokens_per_s": floor, "tracked": True}
    return table


def simulate(
    trace: Trace,
    sps: SpsCurve,
    slots: int,
    options: dict,
    floor: float,
    recalibrate: bool = False,
) -> dict:
    """Closed-loop replay at fixed concurrency through the engine's controller; throughput,
    per-user speeds, share of users (slots) whose realised speed reaches `floor`. With
    `recalibrate` the controller recalibrates confidences online from each step's outcome."""
    options = dict(options)
    tracked = options.pop("tracked", False)
    plugin = PluginOptions(**options, sps_table=sps.points, recalibrate=recalibrate, measure_step_overhead=False)
    controller = VerificationController(plugin, sps, can_time_steps=False)
    steps = max(MIN_STEPS, math.ceil(ROUNDS_PER_POINT / slots))
    groups = len(trace.starts)
    group = np.arange(slots) % groups
    offset = np.zeros(slots, dtype=np.int64)
    next_group = slots
    req_ids = tuple(map(str, range(slots)))
    proposed = np.full(slots, trace.block)
    sampled = np.zeros(slots, dtype=bool)
    tokens = np.zeros(slots)
    verified = elapsed = 0.0
    for _ in range(steps):
        rounds = trace.starts[group] + offset
        floors = None
        if tracked:
            floors = np.where(tokens < plugin.min_tokens_per_s * elapsed, plugin.min_tokens_per_s, 0.0)
        inputs = StepInputs(req_ids, trace.confidences[rounds], proposed, sampled, min_tokens_per_s=floors)
        lengths = controller.decide(inputs).verified
        controller.step_scheduled(elapsed, 0)
        accepted = np.minimum(trace.accepted[rounds], lengths)
        controller.observe(accepted + 1)
        tokens += accepted + 1
        verified += lengths.sum()
        elapsed += float(sps.step_time(slots + int(lengths.sum())))
        offset += 1
        done = np.flatnonzero(offset >= trace.lengths[group])
        group[done] = (next_group + np.arange(len(done))) % groups
        offset[done] = 0
        next_group += len(done)
    per_user = tokens / elapsed
    return {
        "throughput": float(tokens.sum() / elapsed),
        "per_user": float(per_user.mean()),
        "per_user_p10": float(np.quantile(per_user, 0.1)),
        "verified_per_request": float(verified / (steps * slots)),
        "tokens_per_step": float(tokens.sum() / (steps * slots)),
        "users_meeting_floor": float((per_user >= floor).mean()),
    }


def summarise(results: dict, block: int) -> list[str]:
    """Per concurrency: best fixed k against dspark, dspark_async and sla."""
    lines = []
    for name, by_r in results.items():
        lines += [f"### {name}: dspark against the best fixed k", "",
                  "| R | best fixed | tok/s | dspark | vs best | dspark_async | vs best | threshold "
                  "| sla | sla_tracked | users >= floor: dspark / sla / sla_tracked |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, row in by_r.items():
            fixed = {k: row[f"fixed_k{k}"]["throughput"] for k in range(block + 1)}
            best_k = max(fixed, key=fixed.get)
            best = fixed[best_k]
            lines.append(
                f"| {r} | k={best_k} | {best:.1f} | {row['dspark']['throughput']:.1f} | "
                f"{row['dspark']['throughput'] / best - 1:+.1%} | "
                f"{row['dspark_async']['throughput']:.1f} | "
                f"{row['dspark_async']['throughput'] / best - 1:+.1%} | "
                f"{row['threshold']['throughput']:.1f} | {row['sla']['throughput']:.1f} | "
                f"{row['sla_tracked']['throughput']:.1f} | "
                f"{row['dspark']['users_meeting_floor']:.0%} / {row['sla']['users_meeting_floor']:.0%} / "
                f"{row['sla_tracked']['users_meeting_floor']:.0%} |"
            )
        lines.append("")
        for policy in ("dspark", "dspark_async"):
            behind = [
                f"R={r} ({row[policy]['throughput'] / max(row[f'fixed_k{k}']['throughput'] for k in range(block + 1)) - 1:+.1%})"
                for r, row in by_r.items()
                if row[policy]["throughput"]
                < 0.995 * max(row[f"fixed_k{k}"]["throughput"] for k in range(block + 1))
            ]
            lines.append(f"- {policy} below the best fixed k by more than 0.5%: "
                         f"{', '.join(behind) if behind else 'nowhere'}")
        lines.append("")
    return lines


def recalibration_study(trace: Trace, curves: dict[str, tuple[SpsCurve, float]], results: dict) -> dict:
    """dspark throughput per curve and R: calibrated trace (the main run's), then each
    distortion without and with online recalibration."""
    study: dict[str, dict[str, dict[str, float]]] = {}
    for curve_name, (sps, floor) in curves.items():
        study[curve_name] = {}
        for slots in CONCURRENCY:
            row = {"calibrated": results[curve_name][str(slots)]["dspark"]["throughput"]}
            for name, (slope, shift) in MISCALIBRATIONS.items():
                distorted = distort(trace, slope, shift)
                row[name] = simulate(distorted, sps, slots, {"policy": "dspark"}, floor)["throughput"]
                row[f"{name}, recalibrated"] = simulate(
                    distorted, sps, slots, {"policy": "dspark"}, floor, recalibrate=True
                )["throughput"]
            study[curve_name][str(slots)] = row
    return study


def recalibration_tables(study: dict) -> list[str]:
    lines = ["## Live recalibration: dspark on distorted confidences", "",
             "System tokens/s of `dspark`; the trace's confidences distorted as sigmoid(slope * logit(c) + shift): "
             + ", ".join(f"{name} (slope {slope}, shift {shift:+})" for name, (slope, shift) in MISCALIBRATIONS.items())
             + "; each without and with the scheduler's online recalibration (in brackets: change against the "
             "calibrated trace).", ""]
    for curve, by_r in study.items():
        names = [n for n in next(iter(by_r.values())) if n != "calibrated"]
        lines += [f"### {curve}", "", "| R | calibrated | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r, row in by_r.items():
            cells = [f"{row[n]:.1f} ({row[n] / row['calibrated'] - 1:+.1%})" for n in names]
            lines.append(f"| {r} | {row['calibrated']:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def full_tables(results: dict, names: list[str]) -> list[str]:
    lines = []
    for curve, by_r in results.items():
        for metric, label in (("throughput", "system tokens/s"), ("per_user", "mean per-user tokens/s"),
                              ("verified_per_request", "drafts verified per request per step")):
            lines += [f"### {curve}: {label}", "", "| R | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            lines += [f"| {r} | " + " | ".join(f"{row[n][metric]:.2f}" for n in names) + " |"
                      for r, row in by_r.items()]
            lines.append("")
    return lines


def plot(results: dict, block: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5))
    for ax, (curve, by_r) in zip(np.atleast_1d(axes), results.items()):
        names = list(next(iter(by_r.values())))
        for name in names:
            x = [row[name]["per_user"] for row in by_r.values()]
            y = [row[name]["throughput"] for row in by_r.values()]
            if name.startswith("fixed_k"):
                shade = 0.25 + 0.6 * int(name[7:]) / block
                ax.plot(x, y, "-", color=str(1 - shade), lw=1, label=name)
            else:
                marker, style = STYLES.get(name, ("o", "-"))
                ax.plot(x, y, marker=marker, ls=style, lw=1.8, ms=5, label=name, alpha=0.85)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("per-user tokens/s")
        ax.set_ylabel("system tokens/s")
        ax.set_title(f"{curve} (R = {', '.join(map(str, by_r))})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, help="JSONL trace; default: synthetic")
    parser.add_argument("--write-trace", type=Path, help="also write the trace used as JSONL")
    parser.add_argument("--requests", type=int, default=1500, help="synthetic trace size")
    parser.add_argument("--block", type=int, default=7, help="synthetic trace K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--cpu-floor", type=float, default=10.0, help="sla tokens/s, CPU curve")
    parser.add_argument("--gpu-floor", type=float, default=150.0, help="sla tokens/s, GPU curve")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    start = time.perf_counter()
    trace = load_trace(args.trace) if args.trace else synthetic_trace(args.requests, args.block, args.seed)
    if args.write_trace:
        request = np.repeat(np.arange(len(trace.starts)), trace.lengths)
        args.write_trace.write_text("".join(
            json.dumps({"confidences": np.round(c, 4).tolist(), "accepted": int(a), "request": int(g)}) + "\n"
            for c, a, g in zip(trace.confidences, trace.accepted, request)))
    curves = {"cpu_smollm2": (cpu_curve(), args.cpu_floor), "gpu_like": (gpu_like_curve(), args.gpu_floor)}
    results: dict[str, dict[str, dict]] = {}
    for curve_name, (sps, floor) in curves.items():
        table = policies(trace.block, args.threshold, floor)
        results[curve_name] = {}
        for slots in CONCURRENCY:
            row = {name: simulate(trace, sps, slots, opts, floor) for name, opts in table.items()}
            results[curve_name][str(slots)] = row
            print(f"{curve_name} R={slots}: " + ", ".join(
                f"{n}={v['throughput']:.0f}" for n, v in row.items()), flush=True)
    study = recalibration_study(trace, curves, results)
    meta = {
        "trace": str(args.trace) if args.trace else f"synthetic(requests={args.requests}, seed={args.seed})",
        "rounds": int(len(trace.accepted)),
        "requests": int(len(trace.starts)),
        "block": trace.block,
        "mean_accepted_length_full_block": float(trace.accepted.mean() + 1),
        "survival_calibration_error": calibration_error(trace),
        "threshold": args.threshold,
        "sla_floor_tokens_per_s": {name: floor for name, (_, floor) in curves.items()},
        "rounds_per_point": ROUNDS_PER_POINT,
        "curves": {name: sps.metadata for name, (sps, _) in curves.items()},
        "runtime_s": round(time.perf_counter() - start, 1),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "simulate_scheduling.json").write_text(
        json.dumps({"meta": meta, "results": results, "recalibration": study}, indent=1) + "\n")
    names = list(policies(trace.block, args.threshold, 0.0))
    header = [
        "# Scheduling simulator", "",
        f"Trace: {meta['trace']}, {meta['rounds']} rounds, K = {trace.block}, mean accepted length "
        f"at full K {meta['mean_accepted_length_full_block']:.2f}, survival ECE "
        f"{meta['survival_calibration_error']:.3f}. sla floors: CPU {args.cpu_floor} tok/s, "
        f"GPU-like {args.gpu_floor} tok/s; threshold {args.threshold}; dspark_async budget planned "
        f"on the previous step's confidences (as in the engine). Runtime {meta['runtime_s']} s.", "",
    ]
    (args.out_dir / "simulate_scheduling.md").write_text(
        "\n".join(header + summarise(results, trace.block) + recalibration_tables(study)
                  + full_tables(results, names)) + "\n")
    plot(results, trace.block, args.out_dir / "simulate_scheduling.png")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
