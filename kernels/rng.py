"""Counter-based random numbers that are bit-identical in Triton and in PyTorch.

Sampled drafting must give the same tokens on the kernel and the reference path, so the
randomness is a pure function of (seed, step, vocabulary index): a 32-bit integer mixer
(Wellons' "lowbias32") chained over the key words, then Gumbel noise from the top 24
bits. The key deliberately omits the request's position in the batch, so a request
with a fixed seed drafts the same tokens whatever else is batched with it.

PyTorch has no full uint32 arithmetic, so the torch side keeps values in int64 and
splits each 32x32-bit product into 16-bit halves to stay exact without overflow.
"""

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
_SEED_SALT = 0x9E3779B9
_INV_2POW24 = 1.0 / 16777216.0
# Triton only reads globals that are constexpr.
_MUL_A_TL = tl.constexpr(_MUL_A)
_MUL_B_TL = tl.constexpr(_MUL_B)
_SEED_SALT_TL = tl.constexpr(_SEED_SALT)
_INV_2POW24_TL = tl.constexpr(_INV_2POW24)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def seed_key(seeds: torch.Tensor) -> torch.Tensor:
    """Per-request 32-bit key from an int64 seed (both halves are used)."""
    seeds = seeds.to(torch.int64)
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    return mix32(hi ^ mix32(lo ^ _SEED_SALT))


def step_key(key: torch.Tensor, step: int) -> torch.Tensor:
    return mix32(key ^ step)


def gumbel(key: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise for every (row key, vocabulary index) pair: [R] x [V] -> [R, V]."""
    h = mix32(key[:, None] ^ vocab[None, :].to(torch.int64))
    u = ((h >> 8).to(torch.float32) + 0.5) * _INV_2POW24
    return -torch.log(-torch.log(u))


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
    """key [BR] uint32, vocab [BV] int -> [BR, BV] float32; same numbers as `gumbel`."""
    h = mix32_tl(key[:, None] ^ vocab[None, :].to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * _INV_2POW24_TL
    return -tl.log(-tl.log(u))
