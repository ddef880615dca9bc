"""The Triton half of `rng`: the same counter-based numbers, computed inside kernels.

Kept apart from `rng` so that the PyTorch half imports without Triton; the constants come
from there, so the two halves cannot drift apart.
"""

import triton
import triton.language as tl

from .rng import INV_2POW24, MUL_A, MUL_B, SEED_SALT

# Triton only reads globals that are constexpr.
_MUL_A_TL = tl.constexpr(MUL_A)
_MUL_B_TL = tl.constexpr(MUL_B)
_SEED_SALT_TL = tl.constexpr(SEED_SALT)
_INV_2POW24_TL = tl.constexpr(INV_2POW24)


@triton.jit
def mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], _MUL_A_TL, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], _MUL_B_TL, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def seed_key_tl(seed):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return mix32_tl(hi ^ mix32_tl(lo ^ tl.full([], _SEED_SALT_TL, tl.uint32)))


@triton.jit
def step_key_tl(key, step):
    """`step` is a uint32 tensor shaped like `key` (loop counters are not tensors in the interpreter)."""
    return mix32_tl(key ^ step)


@triton.jit
def gumbel_tl(key, vocab):
    """key [BR] uint32, vocab [BV] int -> [BR, BV] float32; same numbers as `rng.gumbel`."""
    h = mix32_tl(key[:, None] ^ vocab[None, :].to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * _INV_2POW24_TL
    return -tl.log(-tl.log(u))
