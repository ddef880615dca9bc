"""Shared test fixtures: environment for an in-process vLLM engine, tiny models.

The environment must be set before vLLM is imported anywhere, hence module level.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.setdefault("VLLM_DSPARK_CACHE", str(REPO / ".cache" / "vllm-dspark")))
for name, sub in {
    "VLLM_CACHE_ROOT": "vllm",
    "VLLM_CONFIG_ROOT": "vllm-config",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}.items():
    os.environ.setdefault(name, str(REPO / ".cache" / sub))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama target (vocab 512) without a tokenizer."""
    from tests.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()


# Engines hold the KV cache and model, so they are collected between tests. A full
# collection walks every object of this process (torch, vLLM and transformers imported:
# 0.3-0.6 s), and vLLM runs several while an engine starts. So what survives a test is
# frozen (`gc.freeze`): the collections that follow walk only what was allocated since.
# vLLM unfreezes the heap when it shuts an engine down; each module ends unfrozen, with a
# full collection for what its fixtures released while frozen (the session too: frozen
# objects are never freed at exit).
@pytest.fixture(autouse=True)
def _free_engines():
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _collect_each_module():
    yield
    gc.unfreeze()
    gc.collect()
