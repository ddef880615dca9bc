"""`vllm-dspark profile`: measure the engine throughput curve SPS(B) with real forward passes.

For each batch size B, B requests with a realistic context length are prefilled, then
the engine's decode steps (one pass carrying B tokens) are timed; SPS(B) = 1 / median
step time. The result is an `SpsCurve` (JSON) plus a plot, and can be stored in the
profile cache, keyed by model, dtype, hardware and vLLM version, where the plugin finds
it with `"sps_profile": "auto"`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_dspark.scheduling.profiles import cached_profile_path, load_cached_profile, profile_key
from vllm_dspark.scheduling.sps import SpsCurve

logger = logging.getLogger(__name__)

DEFAULT_BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
# The start-up profile (no cached one reaching the engine's passes): fewer and shorter
# passes, so a start stays bounded (`startup_batch_tokens` picks the sizes); SPS is
# interpolated between these pass sizes and extrapolated beyond the last.
STARTUP_BATCH_TOKENS = (1, 4, 16, 64)
STARTUP_CONTEXT_LEN = 128
STARTUP_STEPS = 6


def time_decode_steps(llm, batch: int, context_len: int, steps: int, vocab_size: int, seed: int) -> list[float]:
    """Seconds of each of `steps` decode passes with `batch` running requests."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    # Requests whose prefill ends early decode while the rest still prefill: they must not
    # finish before the timed steps, so they may run to the context limit (aborted below).
    max_tokens = llm.llm_engine.model_config.max_model_len - context_len
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [f"profile-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = TokensPrompt(prompt_token_ids=rng.integers(10, vocab_size, context_len).tolist())
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (possibly chunked) until every request decodes
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    timings = []
    for _ in range(steps):
        begin = time.perf_counter()
        decoded = len(engine.step())
        timings.append(time.perf_counter() - begin)
        if decoded != batch:
            raise RuntimeError(
                f"profile at B={batch}: a step decoded {decoded} requests, not {batch} (KV cache too "
                "small for the batch? raise VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory, or drop this B)"
            )
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return timings


def profile_max_model_len(model: str, context_len: int, steps: int, max_batch: int) -> int:
    """Room for early requests to decode through the others' prefill (B * context tokens),
    within the model's own limit where its config states one (a shortfall is caught by
    `time_decode_steps`)."""
    from transformers import AutoConfig

    wanted = context_len + steps + max_batch * context_len // 64 + 64
    limit = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def profile_kv_cache_bytes(model: str, max_batch: int, max_model_len: int, dtype: str, block: int = 128) -> int:
    """KV cache the profile needs, with room to spare: `max_batch` requests of
    `max_model_len` tokens in `block`-token blocks. Asking for exactly this, instead of the
    default share of all memory (0.92 of it on CPU), lets the profile run beside other
    engines on the machine."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    tokens = max_batch * -(-max_model_len // block) * block
    return int(1.5 * per_token * tokens) + (64 << 20)


# Warn when making the curve monotone moves a point by more than this fraction.
NOISE_WARNING = 0.2


def monotone_step_times(medians: list[float]) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators).

    A pass with more tokens never costs less, so an inversion is measurement noise (a
    shared machine), and a curve with one would make the policies chase it. Pooling
    averages the violating points instead of lifting every later point to one slow
    outlier, which a running maximum would do.
    """
    blocks: list[list[float]] = []  # [mean, count] of each pooled run
    for value in medians:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1][0] = (blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count)
            blocks[-1][1] += count
    return np.repeat([mean for mean, _ in blocks], [int(count) for _, count in blocks])


def profile_engine(
    model: str,
    batch_tokens: list[int],
    context_len: int = 256,
    steps: int = 8,
    dtype: str = "float32",
    seed: int = 0,
    **engine_kwargs,
) -> SpsCurve:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step() in this process
    from vllm import LLM

    max_batch = max(batch_tokens)
    max_model_len = profile_max_model_len(model, context_len, steps, max_batch)
    engine_kwargs.setdefault("kv_cache_memory_bytes", profile_kv_cache_bytes(model, max_batch, max_model_len, dtype))
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=engine_kwargs.pop("enforce_eager", True),
        max_num_seqs=max_batch,
        max_model_len=max_model_len,
        async_scheduling=False,  # as the speculative engine runs: one step at a time
        enable_prefix_caching=False,
        seed=seed,
        skip_tokenizer_init=True,  # prompts are token ids
        **engine_kwargs,
    )
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    batches = sorted(batch_tokens)
    medians = []
    for batch in tqdm(batches, desc="profile SPS(B)", unit="batch"):
        medians.append(statistics.median(time_decode_steps(llm, batch, context_len, steps, vocab_size, seed)))
        logger.info("B=%d: %.1f ms per step measured", batch, 1000 * medians[-1])
    monotone = monotone_step_times(medians)
    for batch, measured, kept in zip(batches, medians, monotone):
        if abs(kept - measured) > NOISE_WARNING * measured:
            logger.warning(
                "B=%d: %.1f ms measured, %.1f ms after making the curve monotone; the machine "
                "looks busy, profile again when it is idle", batch, 1000 * measured, 1000 * kept,
            )
    points = [(batch, 1.0 / float(seconds)) for batch, seconds in zip(batches, monotone)]
    metadata = profile_key(model, dtype) | {"context_len": str(context_len), "steps": str(steps)}
    return SpsCurve(points=points, metadata=metadata)


def startup_batch_tokens(max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """Pass sizes the start-up profile measures: up to the largest pass this engine runs
    (every request verifying all K drafts), capped at the last start-up size so a start
    stays bounded; beyond it the curve is extrapolated."""
    largest = max(1, min(max_num_seqs * (1 + num_speculative_tokens), STARTUP_BATCH_TOKENS[-1]))
    return [b for b in STARTUP_BATCH_TOKENS if b < largest] + [largest]


def ensure_cached_profile(model: str, dtype: str, max_num_seqs: int, num_speculative_tokens: int) -> Path:
    """Profile this engine once, in a child process so its memory is freed before the
    serving engine starts, unless the profile cache already has one that reaches this
    engine's passes.

    The cache key (model, dtype, hardware, vLLM version) says nothing of the range a
    profile measured: a cached one made for a smaller engine (one request at a time) would
    leave a larger engine a flat curve, on which verifying drafts looks free at any load.
    Such a profile is measured again over the larger range and replaces the cached one.
    """
    path = cached_profile_path(profile_key(model, dtype))
    batch_tokens = startup_batch_tokens(max_num_seqs, num_speculative_tokens)
    if path.is_file():
        measured_up_to = load_cached_profile(path, model).points[-1][0]
        if measured_up_to >= batch_tokens[-1]:
            return path
        logger.info("vllm_dspark: the cached SPS profile %s stops at passes of %d tokens and this engine's reach "
                    "%d; measuring it again over the larger range", path, measured_up_to, batch_tokens[-1])
    command = [sys.executable, "-m", "vllm_dspark.cli", "profile", "--model", model, "--dtype", dtype,
               "--out", str(path), "--cache", "--batch-tokens", *map(str, batch_tokens),
               "--context-len", str(STARTUP_CONTEXT_LEN), "--steps", str(STARTUP_STEPS)]
    logger.info("vllm_dspark: measuring the SPS profile of this engine now (bounded: %d batch sizes, %d steps "
                "each; cached for the next start): %s", len(batch_tokens), STARTUP_STEPS, " ".join(command))
    # The target as the plugin runs it: in this process's steps, on the V1 runner; its KV
    # cache sized by `profile_kv_cache_bytes` (vllm-cpu's VLLM_CPU_KVCACHE_SPACE, meant for
    # the server, would override that).
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    subprocess.run(command, check=True, env=env)
    return path


def plot_curve(curve: SpsCurve, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = [b for b, _ in curve.points]
    sps = [s for _, s in curve.points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(batch, [1000.0 / s for s in sps], "o-")
    left.set(xscale="log", xlabel="tokens per pass B", ylabel="ms per step", title="step time")
    right.plot(batch, [b * s for b, s in zip(batch, sps)], "o-")
    right.set(xscale="log", xlabel="tokens per pass B", ylabel="tokens/s (B x SPS)", title="token throughput")
    fig.suptitle(f"{Path(curve.metadata.get('model', '?')).name} on {curve.metadata.get('hardware', '?')}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _run(args: argparse.Namespace) -> int:
    curve = profile_engine(args.model, args.batch_tokens, args.context_len, args.steps, args.dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    curve.save(out)
    plot_curve(curve, out.with_suffix(".png"))
    if args.cache:
        cached = cached_profile_path(profile_key(args.model, args.dtype))
        cached.parent.mkdir(parents=True, exist_ok=True)
        curve.save(cached)
        print(f"cached for \"sps_profile\": \"auto\": {cached}")
    for batch, sps in curve.points:
        print(f"B={batch:5d}  {1000.0 / sps:8.1f} ms/step  {sps:7.2f} steps/s")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="measure the engine throughput curve SPS(B)")
    parser.add_argument("--model", required=True, help="target model (the one being served)")
    parser.add_argument("--out", required=True, help="output JSON (a PNG plot is written next to it)")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=list(DEFAULT_BATCH_TOKENS))
    parser.add_argument("--context-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache", action="store_true", help="also store it where sps_profile=auto looks")
    parser.set_defaults(func=_run)
