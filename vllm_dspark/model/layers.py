"""Draft decoder layers with KV injection (DSPARK.md section 1), in plain PyTorch.

The arithmetic follows what vLLM's DFlash draft model computes on the serving path, so a
drafter trained here drafts the same tokens when it runs inside the engine:
context features are RMS-normalised once (`hidden_norm`), projected to keys/values by
every layer's own k/v projections, keys get the per-head `k_norm` and RoPE at their
absolute positions; block tokens go through ordinary pre-norm decoder layers whose
attention sees the injected context plus the block itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dspark.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE. x: [..., S, H, D], positions: [..., S] (same leading dims)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * inv_freq  # [..., S, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(-2)  # [..., S, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(-2)
    x32 = x.float()
    half = head_dim // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class InjectedAttention(nn.Module):
    """Self-attention of block queries over [injected context K/V ; block K/V]."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def keys_values(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, d] -> keys and values [B, S, Hkv, D] (keys normed and rotated)."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        return apply_rope(k, positions, self.rope_theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, S, d] block hidden (normed), positions [B, S], mask [B, S, T + S] (True = see)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim))
        q = apply_rope(q, positions, self.rope_theta)
        k_blk, v_blk = self.keys_values(x, positions)
        k = torch.cat([context_kv[0], k_blk], dim=1)
        v = torch.cat([context_kv[1], v_blk], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = InjectedAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
