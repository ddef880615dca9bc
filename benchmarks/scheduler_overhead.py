"""Wall-clock cost of one verification-length decision, per policy and batch size.

The policy runs on the engine's critical path once per step, so its cost must stay far
below a step (tens of milliseconds on CPU, about ten on GPU). Measures the median of many
single decisions of each policy object, built once as the engine builds it (and of
`dspark_budget`, which the asynchronous variant runs once per step as well, of the live
recalibration's apply + observe, which every policy adds per step when `recalibrate` is
on, and of the whole controller step the engine runs: decide, step_scheduled, observe,
with recalibration; and of the step the default hybrid engine runs: the same with the
n-gram lookup, the drafter skip's rule, the choice between proposals and the drafting
plan) for R requests with K = 7 drafts each, cycling through a pool of different
confidence arrays. Writes benchmarks/results/scheduler_overhead.{json,md}.

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
from vllm_dspark.scheduling import SpsCurve, dspark_budget, hybrid
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
                    "controller_step": controller_step, "hybrid_step": hybrid_step(num_requests)[0]}


def hybrid_step(num_requests: int) -> tuple[Callable[[np.ndarray], None], VerificationController]:
    """One step of the default (hybrid) engine's plugin work outside vLLM, in the order the
    engine makes it: the step starts and the controller decides the lengths of the pending
    proposals (n-gram continuations where the choice took them, the drafter's blocks
    elsewhere), the step is scheduled and its drafting planned, the worker looks up every
    request's continuation on contexts of 300-600 tokens and applies the skip's rule, the
    drafts arrive and the controller chooses between the proposals, and the outcome comes
    back. The greedy requests accept a random part of what they verify. Returns the step
    (confidences [R, K] of the drafter's next blocks) and the controller it drives."""
    rng = np.random.default_rng(1)
    options = PluginOptions(policy="dspark", sps_table=CURVE.points)
    controller = VerificationController(options, CURVE, num_speculative_tokens=BLOCK)
    req_ids = tuple(map(str, range(num_requests)))
    greedy = np.ones(num_requests, dtype=bool)
    token_ids = rng.integers(0, 50, size=(num_requests, 600))  # a small vocabulary: continuations are found
    rows = np.arange(num_requests)
    state = {"step": 0, "depth": BLOCK, "pending": None}

    def step(c: np.ndarray) -> None:
        state["step"] += 1
        controller.step_started(0.05 * state["step"])
        pending = state["pending"]
        ids: tuple[str, ...] = ()
        if pending is not None:
            chosen, proposals = pending
            proposed = np.where(chosen, proposals.lengths, state["depth"])
            drafting = proposed > 0
            ids = tuple(np.array(req_ids)[drafting])
            confidences = np.where(np.arange(BLOCK) < proposed[:, None], c, 0.0)[drafting]
            matches = np.where(chosen, proposals.matches, 0)[drafting]
            decision = controller.decide(StepInputs(ids, confidences, proposed[drafting], greedy[drafting],
                                                    ngram_matches=matches))
        scheduled = dict(zip(ids, decision.verified.tolist())) if ids else {}
        controller.step_scheduled(0.05 * state["step"], num_requests + sum(scheduled.values()), scheduled, 0,
                                  num_requests)
        plan = controller.plan_drafting(num_requests)
        proposals = hybrid.lookup_continuations(token_ids, 300 + state["step"] % 200 + rows % 100, rows, BLOCK, 8192)
        skipped = plan.drafter_skip is not None and plan.drafter_skip.applies(proposals, greedy)
        depth = 0 if skipped else plan.depth
        controller.observe_drafting(num_requests, depth, num_requests * depth, 0.004 if depth else 0.001, skipped)
        state["pending"] = (controller.prefer_ngram(c[:, 0] if depth else np.zeros(num_requests), greedy, proposals,
                                                    depth), proposals)
        state["depth"] = depth
        if ids:
            controller.observe(np.minimum(rng.integers(0, 4, size=len(ids)), decision.verified) + 1)
        else:
            controller.observe(None)

    return step, controller


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
