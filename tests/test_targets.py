"""SmolLM2 target: conversion bookkeeping (fast, faked) and the real checkpoint in vLLM.

The real conversion runs once (about 25 s) into `$VLLM_DSPARK_CACHE` or the repo's
git-ignored `.cache/vllm-dspark`; later runs reuse it and take a few seconds plus vLLM's
start-up.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vllm_dspark.targets import smollm2

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    cache = os.environ.get("VLLM_DSPARK_CACHE") or str(REPO / ".cache" / "vllm-dspark")
    return smollm2.smollm2_checkpoint(cache)


def _fake_convert(calls: list[Path]):
    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / smollm2.MARKER_NAME).write_text("{}")

    return convert


def test_conversion_is_idempotent_and_atomic(tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "find_gguf", lambda: Path("fake.gguf"))
    monkeypatch.setattr(smollm2, "convert_gguf", _fake_convert(calls))

    path = smollm2.smollm2_checkpoint(tmp_path)
    assert path == tmp_path / "targets" / smollm2.CHECKPOINT_NAME
    assert smollm2.smollm2_checkpoint(tmp_path) == path
    assert len(calls) == 1, "a complete checkpoint must not be converted again"
    assert calls[0] != path, "conversion must write into a temporary directory"
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(smollm2, "find_gguf", lambda: Path("fake.gguf"))
    monkeypatch.setattr(smollm2, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        smollm2.smollm2_checkpoint(tmp_path)
    targets = tmp_path / "targets"
    assert [p.name for p in targets.iterdir() if not p.name.endswith(".lock")] == []


def test_incomplete_checkpoint_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    stale = tmp_path / "targets" / smollm2.CHECKPOINT_NAME
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("truncated")
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "find_gguf", lambda: Path("fake.gguf"))
    monkeypatch.setattr(smollm2, "convert_gguf", _fake_convert(calls))

    path = smollm2.smollm2_checkpoint(tmp_path)
    assert len(calls) == 1
    assert not (path / "model.safetensors").exists()
    assert smollm2.is_complete(path)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_DSPARK_CACHE", str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path


def test_gguf_is_found_without_importing_package() -> None:
    import sys

    gguf = smollm2.find_gguf(install=False)
    assert gguf.name == smollm2.GGUF_NAME and gguf.stat().st_size > 50_000_000
    assert smollm2.MODULE not in sys.modules


def test_checkpoint_contents(checkpoint: Path) -> None:
    start = time.perf_counter()
    assert smollm2.smollm2_checkpoint(checkpoint.parent.parent) == checkpoint
    assert time.perf_counter() - start < 1.0, "a cached checkpoint must be returned at once"

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )
    assert config["tie_word_embeddings"] and config["dtype"] == "bfloat16"

    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "BF16"

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_vllm_greedy_chat(checkpoint: Path, tmp_path: Path) -> None:
    # tests/conftest.py sets the vLLM environment (caches in .cache, offline, CPU KV space).
    from vllm import LLM, SamplingParams

    llm = LLM(
        str(checkpoint),
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
    )
    outputs = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
        ],
        SamplingParams(temperature=0, max_tokens=40),
        use_tqdm=False,
    )
    assert "Paris" in outputs[0].outputs[0].text
    assert "def factorial" in outputs[1].outputs[0].text
