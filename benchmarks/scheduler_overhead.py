"""Wall-clock cost of one verification-length decision, per policy and batch size.

The policy runs on the engine's critical path once per step, so its cost must stay far
below a step (tens of milliseconds on CPU, about ten on GPU). Measures the median of many
single decisions of each policy object, built once as the engine builds it (and of
`dspark_budget`, which the asynchronous variant runs once per step as well, of the live
recalibration's apply + observe, which every policy adds per step when `recalibrate` is
on, and of the whole controller step the engine runs: decide, step_scheduled, observe,
with recalibration) for R requests with K = 7 drafts each, cycling through a pool of
different confidence arrays. Writes benchmarks/results/scheduler_overhead.{json,md}.

Usage: python benchmarks/scheduler_overhead.py [--calls N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling import SpsCurve, dspark_budget
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.policies import PolicyStep, build_policy, decide_lengths
from vllm_dspark.scheduling.recalibration import OnlineRecalibrator

REQUESTS = (1, 4, 16, 64, 256, 1024)
BLOCK = 7
POOL = 16
# Measured SmolLM2-135M step times on this project's CPU (ENVIRONMENT.md), ms per step.
CPU_STEP_MS = {1: 84, 2: 91, 4: 96, 8: 112, 16: 146, 32: 183, 64: 308, 128: 473}
CURVE = SpsCurve(points=[(b, 1000.0 / ms) for b, ms in CPU_STEP_MS.items()])


def median_us(call: Callable[[np.ndarray], object], pool: list[np.ndarray], calls: int) -> float:
    """Median wall time of single calls, in microseconds, after a short warm-up."""
    for c in pool:
        call(c)
    samples = np.empty(calls)
    for i in range(calls):
        c = pool[i % len(pool)]
        start = time.perf_counter_ns()
        call(c)
        samples[i] = time.perf_counter_ns() - start
    return float(np.median(samples) / 1e3)


def cases(pool: list[np.ndarray]) -> dict[str, Callable[[np.ndarray], object]]:
    """One callable per measured row; the async budget comes from another pool entry."""
    budget = dspark_budget(pool[-1], CURVE)
    recalibrator = OnlineRecalibrator()
    num_requests = pool[0].shape[0]
    verified = np.full(num_requests, BLOCK)
    accepted = np.arange(num_requests) % (BLOCK + 1)

    def recalibrate(c: np.ndarray) -> None:
        recalibrator.apply(c)
        recalibrator.observe(c, verified, accepted)

    options = PluginOptions(policy="dspark", sps_table=CURVE.points, measure_step_overhead=False)
    controller = VerificationController(options, CURVE)
    req_ids = tuple(map(str, range(num_requests)))
    proposed = np.full(num_requests, BLOCK)
    greedy = np.zeros(num_requests, dtype=bool)

    def controller_step(c: np.ndarray) -> None:
        lengths = controller.decide(StepInputs(req_ids, c, proposed, greedy)).verified
        controller.step_scheduled(0.0, 0)
        controller.observe(np.minimum(accepted, lengths) + 1)

    policies = {
        "fixed": build_policy("fixed"),
        "threshold": build_policy("threshold", threshold=0.5),
        "dspark": build_policy("dspark"),
        "dspark_async": build_policy("dspark_async", budget=budget),
        "sla": build_policy("sla", min_tokens_per_s=5.0),
    }
    cases = {name: (lambda c, p=policy: decide_lengths(p, PolicyStep(c, CURVE))) for name, policy in policies.items()}
    return cases | {"dspark_budget": lambda c: dspark_budget(c, CURVE), "recalibrate": recalibrate,
                    "controller_step": controller_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per row (fewer at R=1024)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    for num_requests in REQUESTS:
        pool = [rng.uniform(0.5, 0.95, size=(num_requests, BLOCK)) for _ in range(POOL)]
        calls = args.calls if num_requests <= 256 else max(args.calls // 4, POOL)
        results[str(num_requests)] = {
            name: round(median_us(call, pool, calls), 1) for name, call in cases(pool).items()
        }
        print(num_requests, results[str(num_requests)], flush=True)

    meta = {
        "block": BLOCK,
        "calls_per_row": args.calls,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "sps_curve": "SmolLM2-135M CPU step times (ENVIRONMENT.md)",
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scheduler_overhead.json").write_text(
        json.dumps({"median_us": results, "meta": meta}, indent=2) + "\n"
    )
    names = list(next(iter(results.values())))
    lines = [
        f"# Verification-policy overhead (median us per call, K = {BLOCK})",
        "",
        f"numpy {np.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs "
        f"(shared machine, load average {meta['load_average_at_end'][0]:.2f} at the end).",
        "",
        "| R | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += [f"| {r} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |" for r, row in results.items()]
    (args.out_dir / "scheduler_overhead.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
