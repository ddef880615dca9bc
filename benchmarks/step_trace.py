"""Where a speculative engine's wave time goes, step by step, beside plain decoding.

`serve_frontier.py` measures whole waves; a few percent between two engines is then hard
to place (is every step dearer, or a few steps much dearer?). This script serves the same
interleaved waves (`serve_frontier.run_interleaved`: every engine alive at once, the same
prompts in every row) and times each engine step inside the engine process: the step's
wall time (vLLM's `LLMEngine.step`: schedule, forward, sampling, drafting, output
processing), the requests and tokens of its pass, the drafts it verified and whether the
drafter ran in it. Steps are then grouped as

- `plain`: every request of the pass decodes one token, nothing verified, no drafter pass
  (what a plain engine's decode step is);
- `verify`: drafts verified, no drafter pass in the step;
- `draft`: the drafter ran (the next step's drafts), with or without verification;
- `other`: passes with prompt tokens, and passes with fewer requests than the wave's (its
  ramp and tail).

Per engine the report gives each group's steps per wave and median step, and splits the
wave's summed step time against the plain engine's: each group's extra time (its steps x
(its mean step - the plain engine's mean full-load step)) and the steps saved. It also fits
the steps that prefill a prompt as a fixed cost plus a cost per scheduled token: under a
closed loop (`--requests-per-user`, turns as in `serve_frontier.py`) a new request's
prefill shares its step with the others' decoding, and that step is its wait for the first
token. And it splits each full-load group's mean step into the engine's own parts
(`PARTS`: the scheduler's, the model runner's and the target's methods, timed on the live
engine, the plugin's overrides included): the plugin's own work per step beside a plain
engine's and vLLM's n-gram engine's.

    python benchmarks/step_trace.py --prompts chat --concurrency 4 --repeats 10 \\
        --only no-spec "never drafting (fixed k=0)" dspark "dspark + n-gram"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_frontier  # noqa: E402  (the sibling script: engines, waves, prompts)

GROUPS = ("plain", "verify", "draft", "other")
TRACE_DIR_VARIABLE = "VLLM_DSPARK_STEP_TRACE"  # where an engine process writes its steps
# The engine methods a step is split into: (owner, method) with the owner the engine core's
# scheduler, the worker's model runner or the target model. The target's forward pass is
# `_model_forward` and its LM head `compute_logits`; the runner's sampling step calls
# `_sample` and `propose_draft_token_ids`. None of them calls another, so a step's `rest` is
# its time less their sum.
PARTS = (("scheduler", "schedule"), ("scheduler", "update_from_output"), ("scheduler", "update_draft_token_ids"),
         ("runner", "_prepare_inputs"), ("runner", "_model_forward"), ("model", "compute_logits"),
         ("runner", "_sample"), ("runner", "propose_draft_token_ids"), ("runner", "take_draft_token_ids"))


def step_group(step: dict, requests: int) -> str:
    """The group of one traced step (module docstring) in a wave of `requests`."""
    if prefills(step) or step["requests"] != requests:
        return "other"
    if step["drafted"]:
        return "draft"
    return "verify" if step["verified"] else "plain"


def prefills(step: dict) -> bool:
    """Whether the step scheduled prompt tokens (more than one token per request beyond
    its verified drafts)."""
    return step["tokens"] > step["requests"] + step["verified"]


def traced_serve_waves(conn, *args) -> None:
    """`serve_frontier.serve_waves` with every engine step timed; each wave's steps go to
    a JSON-lines file named by the engine's row (set in its environment)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    steps: list[dict] = []
    parts: dict[str, float] = {}  # the running step's seconds per part
    step = LLMEngine.step

    def timed_step(engine):
        core = engine.engine_core.engine_core  # in-process engine core
        if not getattr(core, "parts_timed", False):
            _time_parts(core, parts)
        parts.clear()
        started = time.perf_counter()
        outputs = step(engine)
        seconds = time.perf_counter() - started
        scheduled = getattr(core.scheduler, "last_traced_output", None)
        if scheduled is not None:
            controller = getattr(core.scheduler, "controller", None)
            steps.append({
                "seconds": seconds,
                "requests": len(scheduled.num_scheduled_tokens),
                "tokens": scheduled.total_num_scheduled_tokens,
                "verified": sum(len(d) for d in scheduled.scheduled_spec_decode_tokens.values()),
                # the drafter's forward pass ran in this step (depth > 0)
                "drafted": bool(controller is not None and controller._drafted_in_step),
                "parts": dict(parts),
            })
            core.scheduler.last_traced_output = None
        return outputs

    LLMEngine.step = timed_step
    _keep_scheduler_outputs()
    out = Path(os.environ[TRACE_DIR_VARIABLE])

    class TracingConnection:
        """Writes the wave's steps beside its timing, then passes the timing on; the
        start-up message drops the warm-up's steps."""

        def send(self, message):
            if isinstance(message, dict) and "seconds" in message:
                with out.open("a") as file:
                    file.write(json.dumps({"wave_seconds": message["seconds"], "steps": steps}) + "\n")
            steps.clear()
            conn.send(message)

        def recv(self):
            return conn.recv()

    serve_frontier.serve_waves(TracingConnection(), *args)


def _time_parts(core, parts: dict[str, float]) -> None:
    """Wrap the `PARTS` methods of this engine core's scheduler, model runner and target
    model so that each adds its wall time to `parts` (once per engine)."""
    runner = core.model_executor.driver_worker.worker.model_runner
    owners = {"scheduler": core.scheduler, "runner": runner, "model": runner.model}
    for owner_name, name in PARTS:
        owner = owners[owner_name]
        method = getattr(owner, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                parts[_name] = parts.get(_name, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)
    core.parts_timed = True


def _keep_scheduler_outputs() -> None:
    """Every scheduler keeps its last output for the step timer (the plugin's scheduler
    calls this one and returns the same object)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def kept(self, *args, **kwargs):
        self.last_traced_output = output = schedule(self, *args, **kwargs)
        return output

    Scheduler.schedule = kept


def summarize(waves: list[dict], requests: int) -> dict:
    """Per group: steps per wave, median and mean step; the summed step time per wave; and
    the full-load groups' mean parts (`mean_parts`)."""
    grouped: dict[str, list[dict]] = {group: [] for group in GROUPS}
    for wave in waves:
        for step in wave["steps"]:
            grouped[step_group(step, requests)].append(step)
    count = max(1, len(waves))
    prefill = [step for wave in waves for step in wave["steps"] if prefills(step)]
    times = {group: [step["seconds"] for step in steps] for group, steps in grouped.items()}
    return {
        "parts": mean_parts(grouped),
        "waves": len(waves),
        "wave_seconds": statistics.median(w["wave_seconds"] for w in waves),
        "step_seconds_per_wave": statistics.median(sum(s["seconds"] for s in w["steps"]) for w in waves),
        "groups": {group: {"steps_per_wave": len(seconds) / count,
                           "median_s": statistics.median(seconds) if seconds else None,
                           "mean_s": statistics.fmean(seconds) if seconds else None}
                   for group, seconds in times.items()},
        "prefill": fit_prefill(prefill, count),
    }


def mean_parts(grouped: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per full-load group of `grouped` steps: the mean seconds of each of the step's
    `PARTS` (0 where a step did not call it) and of the rest of the step, over the steps
    that recorded parts (traces without them give none)."""
    means = {}
    for group, steps in grouped.items():
        timed = [step for step in steps if "parts" in step]
        if group == "other" or not timed:
            continue
        means[group] = {name: statistics.fmean(s["parts"].get(name, 0.0) for s in timed) for _, name in PARTS}
        means[group]["rest"] = statistics.fmean(s["seconds"] - sum(s["parts"].values()) for s in timed)
    return means


def fit_prefill(steps: list[dict], waves: int) -> dict:
    """The steps that prefilled a prompt: per wave, their number and summed seconds (under a
    closed loop at 16 requests they took more than half of the engine's time), their median,
    and seconds fitted as a fixed cost plus a cost per scheduled token (least squares; None
    with fewer than two distinct token counts)."""
    if not steps:
        return {"steps_per_wave": 0.0, "seconds_per_wave": 0.0, "median_s": None, "fixed_s": None,
                "per_token_s": None, "median_tokens": None, "verified": None}
    tokens = np.array([step["tokens"] for step in steps], dtype=float)
    seconds = np.array([step["seconds"] for step in steps])
    fixed = per_token = None
    if len(np.unique(tokens)) > 1:
        per_token, fixed = (float(v) for v in np.polyfit(tokens, seconds, 1))
    return {"steps_per_wave": len(steps) / waves, "seconds_per_wave": float(seconds.sum()) / waves,
            "median_s": float(np.median(seconds)), "fixed_s": fixed,
            "per_token_s": per_token, "median_tokens": float(np.median(tokens)),
            "verified": float(np.mean([step["verified"] for step in steps]))}


def split_against_plain(row: dict, plain: dict) -> dict:
    """The row's summed step time per wave minus the plain engine's, by group: each group's
    extra time over the plain engine's mean full-load step, and the steps saved."""
    reference = plain["groups"]["plain"]["mean_s"]
    extra = {group: stats["steps_per_wave"] * (stats["mean_s"] - reference)
             for group, stats in row["groups"].items() if stats["mean_s"] is not None and group != "other"}
    other, plain_other = row["groups"]["other"], plain["groups"]["other"]
    extra["other"] = ((other["steps_per_wave"] * (other["mean_s"] or 0.0))
                      - (plain_other["steps_per_wave"] * (plain_other["mean_s"] or 0.0)))
    full_load = sum(row["groups"][g]["steps_per_wave"] for g in ("plain", "verify", "draft"))
    extra["steps saved"] = -(plain["groups"]["plain"]["steps_per_wave"] - full_load) * reference
    return extra


def write_report(summaries: dict[str, dict], meta: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": summaries}, indent=1))
    plain = summaries.get("no-spec")
    lines = [
        "# Step trace (real engine, CPU)",
        "",
        f"{meta['prompts']} prompts, R = {meta['concurrency']}, {meta['repeats']} interleaved "
        + (f"waves of {meta['max_tokens']} greedy tokens per request" if meta.get("requests_per_user", 1) == 1 else
           f"closed-loop turns ({meta['requests_per_user']} requests per user, greedy, output lengths "
           "{}-{} tokens as in `serve_frontier.py`; a wave below is a turn)".format(
               *serve_frontier.closed_loop_lengths(meta["max_tokens"])))
        + f", measured {meta['date']} on {meta['hardware']}. "
        "Milliseconds; `plain`, `verify`, `draft` are full-load decode steps (module docstring of "
        "`benchmarks/step_trace.py`), `other` the prefill, ramp and tail. The last columns split the row's summed "
        "step time per wave against no-spec's: each group's steps x (its mean - no-spec's mean plain step), "
        "`other` against no-spec's own, and the steps it saved (negative: time saved).",
        "",
        "| configuration | wave s | summed steps s | plain steps/wave (median ms) | verify | draft | other "
        "| extra ms: plain | verify | draft | other | steps saved | total |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summaries.items():
        cells = []
        for group in GROUPS:
            stats = row["groups"][group]
            median = "-" if stats["median_s"] is None else f"{1000 * stats['median_s']:.1f}"
            cells.append(f"{stats['steps_per_wave']:.1f} ({median})")
        split = split_against_plain(row, plain) if plain else {}
        parts = [f"{1000 * split[k]:+.0f}" if k in split else "-" for k in (*GROUPS, "steps saved")]
        total = f"{1000 * sum(split.values()):+.0f}" if split else "-"
        lines.append(f"| {name} | {row['wave_seconds']:.3f} | {row['step_seconds_per_wave']:.3f} | "
                     + " | ".join(cells) + " | " + " | ".join(parts) + f" | {total} |")
    lines += ["", "Steps that prefilled a prompt, fitted as fixed + per scheduled token (least squares):", "",
              "| configuration | prefill steps/wave | their s/wave | median ms | median tokens | fixed ms | ms per token "
              "| drafts verified in them (mean) |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in summaries.items():
        p = row["prefill"]
        cells = [f"{p['steps_per_wave']:.1f}", f"{p['seconds_per_wave']:.2f}"]
        cells += ["-" if p[key] is None else f"{scale * p[key]:.{digits}f}" for key, scale, digits in
                  (("median_s", 1000, 1), ("median_tokens", 1, 0), ("fixed_s", 1000, 1), ("per_token_s", 1000, 2),
                   ("verified", 1, 1))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Mean ms of a full-load step's parts (`PARTS`: the engine core's scheduler, the worker's model "
              "runner and the target model, timed on the live engine; `rest` is the step's time outside them):", "",
              "| configuration | group | " + " | ".join(name for _, name in PARTS) + " | rest |",
              "|---|---|" + "---|" * (len(PARTS) + 1)]
    columns = [part for _, part in PARTS] + ["rest"]
    for name, row in summaries.items():
        for group, means in row.get("parts", {}).items():
            lines.append(f"| {name} | {group} | " + " | ".join(f"{1000 * means[part]:.2f}" for part in columns) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", required=True, help="rows of serve_frontier.configurations; include no-spec")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-user", type=int, default=1,
                        help="1: waves of R requests; N > 1: closed-loop turns of N x R requests (serve_frontier.py)")
    parser.add_argument("--prompts", choices=sorted(serve_frontier.PROMPT_SETS), default="chat")
    parser.add_argument("--drafter", default=str(serve_frontier.REPO / "examples" / "drafters" / "smollm2-dspark-b7"))
    parser.add_argument("--baseline-commit", default=None,
                        help="also run every vllm_dspark row with the plugin of this commit (as serve_frontier does)")
    parser.add_argument("--out", type=Path, default=serve_frontier.RESULTS / "step_trace")
    args = parser.parse_args()
    from vllm_dspark.scheduling.profiles import hardware_name
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    rows = serve_frontier.configurations(args.drafter, 7)
    plan = {name: rows[name] for name in args.only}
    if args.baseline_commit:  # each plugin row beside the same row at that commit
        plugin = serve_frontier.plugin_at_commit(args.baseline_commit, Path(tempfile.mkdtemp(prefix="vllm-dspark-baseline-")))
        plan = serve_frontier.with_commit(plan, args.baseline_commit, plugin)
    traces = Path(tempfile.mkdtemp(prefix="step_trace_"))
    plan = {name: settings | {"environment": {TRACE_DIR_VARIABLE: str(traces / f"{index}.jsonl")}}
            for index, (name, settings) in enumerate(plan.items())}
    serve_frontier.serve_waves = traced_serve_waves  # what run_interleaved starts in each engine process
    serve_frontier.run_interleaved(str(smollm2_checkpoint()), plan, [args.concurrency], args.max_tokens,
                                   args.repeats, args.prompts, lambda results, curve: None, args.requests_per_user)
    summaries = {}
    for index, name in enumerate(plan):
        waves = [json.loads(line) for line in (traces / f"{index}.jsonl").read_text().splitlines()]
        summaries[name] = summarize(waves, args.concurrency)
    meta = {"prompts": args.prompts, "concurrency": args.concurrency, "repeats": args.repeats,
            "requests_per_user": args.requests_per_user,
            "baseline_commit": args.baseline_commit,
            "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "hardware": hardware_name()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(summaries, meta, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
