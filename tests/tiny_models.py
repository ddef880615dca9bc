"""Tiny random models and engine helpers for tests (never used for reported numbers)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.init_drafter import init_drafter

TINY_VOCAB = 512


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """A 4-layer Llama with SmolLM2's shape conventions (GQA, tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger embeddings make greedy decoding of a random model less degenerate.
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_drafter(target: Path, out_dir: Path, **options: Any) -> Path:
    options.setdefault("num_layers", 1)
    options.setdefault("block_size", 4)
    options.setdefault("markov_rank", 32)
    init_drafter(target, out_dir, seed=1, **options)
    return out_dir


def fit_markov_to_transitions(
    drafter_dir: Path, target: Path, sequences: list[list[int]], scale: float = 60.0, confidence_gain: float = 30.0
) -> None:
    """Make the Markov head predict the most frequent successor of each token seen in
    `sequences` (e.g. the target's own greedy outputs), so a random drafter gets real,
    partial acceptance in engine tests. The bias dominates the random backbone logits;
    the confidence head is sharpened so confidences differ clearly between requests."""
    drafter = DSparkDrafter.from_pretrained(drafter_dir, target)
    head = drafter.markov_head
    assert head is not None
    successors: dict[int, Counter] = {}
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            successors.setdefault(prev, Counter())[nxt] += 1
    prevs = sorted(successors)[: head.rank]
    with torch.no_grad():
        w1 = head.markov_w1.weight  # [V, r]
        x = w1[prevs].T  # [r, n]
        y = torch.zeros(w1.shape[0], len(prevs))
        for col, prev in enumerate(prevs):
            y[successors[prev].most_common(1)[0][0], col] = scale
        head.markov_w2.weight.copy_(y @ torch.linalg.pinv(x))
        assert drafter.confidence_head is not None
        drafter.confidence_head.proj.weight.mul_(confidence_gain)
    drafter.save_pretrained(drafter_dir)


def make_llm(target: Path, speculative_config: dict | None = None, additional_config: dict | None = None, **kwargs: Any):
    from vllm import LLM

    has_tokenizer = (target / "tokenizer_config.json").is_file()
    settings: dict[str, Any] = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,
        skip_tokenizer_init=not has_tokenizer,
        speculative_config=speculative_config,
        additional_config=additional_config or {},
    )
    settings.update(kwargs)
    return LLM(**settings)


def engine_scheduler(llm):
    """The scheduler of an in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def engine_runner(llm):
    """The model runner of an in-process engine's one worker."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def record_decisions(llm) -> list:
    """Every VerifyDecision the engine's controller makes from now on, in order."""
    controller = engine_scheduler(llm).controller
    decisions: list = []
    decide = controller.decide

    def recording(step):
        decisions.append(decide(step))
        return decisions[-1]

    controller.decide = recording
    return decisions


def generate_ids(llm, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counters(llm) -> dict[str, int]:
    """vLLM's own speculative-decoding counters from the engine's metrics."""
    counts: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counts[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
    return counts
