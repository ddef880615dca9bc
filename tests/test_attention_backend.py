"""The opt-in verification attention backend, on CPU.

vLLM's CPU build cannot run FlashAttention, so these tests drive the backend's impl
directly: FlashAttention's KV-cache layout and metadata, the kernel entry point in its
PyTorch reference, and a spy on the parent's forward for steps the kernel must not take.
The kernel itself on this strided layout is checked in the interpreter (test_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata

import vllm_dspark
from vllm_dspark.integration import attention_backend
from vllm_dspark.integration.attention_backend import (
    DSparkVerifyAttentionBackend,
    DSparkVerifyAttentionImpl,
    verify_attention_forward,
)
from vllm_dspark.kernels import dispatch

HEAD_SIZE = 64
NUM_KV_HEADS = 2
GROUP = 3
BLOCK_SIZE = 16
PADDING_TOKENS = 2  # vLLM pads the token dimension beyond num_actual_tokens


def flash_step(query_lens: list[int], context_lens: list[int], seed: int = 0, layout: str = "HND"):
    """A step as FlashAttention sees it: the new tokens' K/V already written to the cache.
    The cache is the [blocks, kv_heads, block_size, 2 * D] view vLLM hands the layer, over
    memory stored heads-major (HND) or tokens-major (NHD)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    if layout == "HND":
        kv_cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=g)
    else:
        kv_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE, generator=g).transpose(1, 2)
    pool = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(query_lens), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = pool[used : used + n]
        used += n
    total = sum(query_lens)
    query = torch.randn(total + PADDING_TOKENS, NUM_KV_HEADS * GROUP, HEAD_SIZE, generator=g)
    key = torch.randn(total + PADDING_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    value = torch.randn(total + PADDING_TOKENS, NUM_KV_HEADS, HEAD_SIZE, generator=g)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    slots = []
    for r, (ctx, n) in enumerate(zip(context_lens, query_lens)):
        for i, pos in enumerate(range(ctx, ctx + n)):
            block, offset = int(block_table[r, pos // BLOCK_SIZE]), pos % BLOCK_SIZE
            key_cache[block, offset] = key[cu[r] + i]
            value_cache[block, offset] = value[cu[r] + i]
            slots.append(block * BLOCK_SIZE + offset)
    metadata = FlashAttentionMetadata(
        num_actual_tokens=total,
        max_query_len=max(query_lens),
        query_start_loc=cu,
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return query, key, value, kv_cache, metadata


def sdpa_over_cache(query, kv_cache, metadata) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole sequence in the cache."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    cu = metadata.query_start_loc.tolist()
    out = torch.empty(metadata.num_actual_tokens, query.shape[1], HEAD_SIZE)
    for r in range(len(cu) - 1):
        n, seq = cu[r + 1] - cu[r], int(metadata.seq_lens[r])
        pos = torch.arange(seq)
        blocks = metadata.block_table[r, pos // BLOCK_SIZE].long()
        keys = key_cache[blocks, pos % BLOCK_SIZE].repeat_interleave(GROUP, dim=1).transpose(0, 1)
        vals = value_cache[blocks, pos % BLOCK_SIZE].repeat_interleave(GROUP, dim=1).transpose(0, 1)
        mask = torch.ones(n, seq, dtype=torch.bool).tril(diagonal=seq - n)
        q = query[cu[r] : cu[r + 1]].transpose(0, 1)
        out[cu[r] : cu[r + 1]] = torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask).transpose(0, 1)
    return out


def poisoned_output(query: torch.Tensor) -> torch.Tensor:
    return torch.full_like(query, float("nan"))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_forward_matches_attention_over_the_flash_cache(layout: str) -> None:
    query, key, value, kv_cache, metadata = flash_step([1, 4, 8, 3], [5, 0, 37, 16], layout=layout)
    output = poisoned_output(query)
    verify_attention_forward(query, key, value, kv_cache, metadata, output, HEAD_SIZE, HEAD_SIZE**-0.5, use_kernel=False)
    torch.testing.assert_close(output[: metadata.num_actual_tokens], sdpa_over_cache(query, kv_cache, metadata))
    assert output[metadata.num_actual_tokens :].isnan().all(), "padding rows must stay untouched"


@pytest.fixture
def routed(monkeypatch):
    """Kernels enabled (entry point runs its reference), FlashAttention's forward spied."""
    calls: list[str] = []
    entry = dispatch.verify_attention

    def kernel_spy(*args, **kwargs):
        calls.append("kernel")
        return entry(*args, **{**kwargs, "use_kernel": False})

    def flash_spy(self, layer, query, key, value, kv_cache, metadata, output, *rest):
        calls.append("flash")
        return output

    monkeypatch.setattr(dispatch, "triton_kernels_enabled", lambda: True)
    monkeypatch.setattr(dispatch, "verify_attention", kernel_spy)
    monkeypatch.setattr(FlashAttentionImpl, "forward", flash_spy)
    return calls


def make_impl(max_verify_tokens: int, **layer) -> DSparkVerifyAttentionImpl:
    impl = DSparkVerifyAttentionImpl(
        NUM_KV_HEADS * GROUP, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS,
        layer.get("alibi_slopes"), layer.get("sliding_window"), "auto", layer.get("logits_soft_cap"),
    )
    assert impl.max_verify_tokens == 1, "no vLLM config here: plain decode steps only"
    impl.max_verify_tokens = max_verify_tokens
    return impl


def test_verification_steps_take_the_kernel(routed) -> None:
    query, key, value, kv_cache, metadata = flash_step([5, 1, 3], [9, 20, 0])
    output = poisoned_output(query)
    make_impl(5).forward(None, query, key, value, kv_cache, metadata, output)
    assert routed == ["kernel"]
    torch.testing.assert_close(output[: metadata.num_actual_tokens], sdpa_over_cache(query, kv_cache, metadata))


@pytest.mark.parametrize(
    "case",
    ["prefill_longer_than_k_plus_1", "sliding_window", "soft_cap", "non_causal", "prefix_lm_mask", "profiling_run",
     "forced_reference"],
)
def test_other_steps_go_to_flash_attention(routed, monkeypatch, case: str) -> None:
    query, key, value, kv_cache, metadata = flash_step([6, 2], [3, 11])
    impl = make_impl(8)
    if case == "prefill_longer_than_k_plus_1":
        impl = make_impl(5)
    elif case == "sliding_window":
        impl = make_impl(8, sliding_window=4)
    elif case == "soft_cap":
        impl = make_impl(8, logits_soft_cap=30.0)
    elif case == "non_causal":
        metadata.causal = False
    elif case == "prefix_lm_mask":
        metadata.mm_prefix_query_range_tensor = torch.full((metadata.num_actual_tokens, 2), -1)
    elif case == "profiling_run":
        metadata = None
    elif case == "forced_reference":
        monkeypatch.undo()  # the real capability check: CUDA "present", the switch set
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
        monkeypatch.setattr(FlashAttentionImpl, "forward", lambda *a: routed.append("flash"))
        impl = make_impl(8)
    impl.forward(None, query, key, value, kv_cache, metadata, poisoned_output(query))
    assert routed == ["flash"]


def test_plugin_registers_the_backend_in_the_custom_slot() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_dspark.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is DSparkVerifyAttentionBackend
    assert DSparkVerifyAttentionBackend.get_impl_cls() is DSparkVerifyAttentionImpl
    assert attention_backend.__name__ + ".DSparkVerifyAttentionBackend" == AttentionBackendEnum.CUSTOM.get_path()
