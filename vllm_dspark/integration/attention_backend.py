"""Opt-in vLLM attention backend: verification steps run the Triton verification kernel.

It is vLLM's FlashAttention backend with one change in `forward`. When every request of
the step brings at most K+1 query tokens (decode and verification steps) and the layer
uses nothing the kernel lacks (sliding window, ALiBi, soft cap, sinks, a quantised or
shared KV cache, context parallelism, non-causal masks), attention runs in
`vllm_dspark.kernels.verify_attention`: one launch for all requests, no padding to the
longest. Everything else (prefill chunks, encoder attention, the profiling run, prefix-LM
and sliding-prefix masks, batch-invariant mode) goes to FlashAttention unchanged. The
KV-cache layout and the cache writes are FlashAttention's, so either path can serve any
step.

Select it with `--attention-backend CUSTOM` (the plugin registers it there; see
`vllm_patches.py`). `VLLM_DSPARK_FORCE_REFERENCE=1` or a machine without CUDA and Triton
sends every step back to FlashAttention.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
)

from vllm_dspark.kernels import dispatch

logger = init_logger(__name__)


def verify_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: FlashAttentionMetadata,
    output: torch.Tensor,
    head_size: int,
    scale: float,
    use_kernel: bool = True,
) -> torch.Tensor:
    """Attention of a step whose new keys/values are already in the cache, written into
    `output[:num_actual_tokens]` ([tokens, heads, head_size], as vLLM passes it).

    The kernel reads a request's cached context (seq_len - query_len tokens) through the
    block table and its new tokens from `key`/`value`, causal among the new tokens.
    `use_kernel=False` runs the PyTorch reference instead (tests on CPU).
    """
    num_tokens = metadata.num_actual_tokens
    cu_seqlens_q = metadata.query_start_loc
    num_requests = cu_seqlens_q.shape[0] - 1
    # FlashAttention's layout: [blocks, kv_heads, block_size, 2 * head_size] viewed as two
    # [blocks, block_size, kv_heads, head_size] caches (strided; the kernel takes strides).
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    context_lens = metadata.seq_lens[:num_requests] - (cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    dispatch.verify_attention(
        query[:num_tokens],
        key[:num_tokens],
        value[:num_tokens],
        key_cache,
        value_cache,
        metadata.block_table[:num_requests],
        context_lens,
        cu_seqlens_q,
        scale=scale,
        max_q=metadata.max_query_len,
        out=output[:num_tokens],
        use_kernel=use_kernel,
    )
    return output


class DSparkVerifyAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        spec = vllm_config.speculative_config if vllm_config is not None else None
        # Steps up to K+1 tokens per request are verification (or plain decode) steps.
        self.max_verify_tokens = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
        # Decided once per layer: forward runs per layer per step and must stay cheap.
        self.kernel_supports_layer = (
            dispatch.triton_kernels_enabled()
            and self.attn_type == AttentionType.DECODER
            and self.alibi_slopes is None
            and self.sliding_window == (-1, -1)
            and not self.logits_soft_cap
            and self.sinks is None
            and self.head_size <= 256  # larger heads would not fit the kernel's tiles
            and self.kv_cache_dtype == "auto"
            and self.kv_sharing_target_layer_name is None
            and self.dcp_world_size <= 1
            and not self.batch_invariant_enabled  # FlashAttention owns that numerics contract
        )
        logger.info_once(
            "vllm_dspark attention backend: steps with at most %d tokens per request %s",
            self.max_verify_tokens,
            "run the Triton verification kernel" if self.kernel_supports_layer
            else "stay on FlashAttention (kernels off or a layer feature the kernel lacks)",
        )

    def uses_kernel(self, metadata: FlashAttentionMetadata | None) -> bool:
        return (
            metadata is not None
            and self.kernel_supports_layer
            and metadata.causal is True
            and metadata.max_query_len <= self.max_verify_tokens
            # FlashAttention-4 mask modes the kernel does not implement:
            and metadata.mm_prefix_query_range_tensor is None
            and metadata.rswa_prefix_lens is None
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is None and output_block_scale is None and self.uses_kernel(attn_metadata):
            return verify_attention_forward(
                query, key, value, kv_cache, attn_metadata, output, self.head_size, self.scale
            )
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )


class DSparkVerifyAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[DSparkVerifyAttentionImpl]:
        return DSparkVerifyAttentionImpl
