"""Counter-based random numbers that are bit-identical in Triton and in PyTorch.

Sampled drafting must give the same tokens on the kernel and the reference path, so the
randomness is a pure function of (seed, step, vocabulary index): a 32-bit integer mixer
(Wellons' "lowbias32") chained over the key words, then Gumbel noise from the top 24
bits. The key deliberately omits the request's position in the batch, so a request
with a fixed seed drafts the same tokens whatever else is batched with it.

This is the PyTorch half; it imports without Triton, so the model's sequential stage
(`vllm_dspark.model.heads`) can use it on any machine. The Triton half, `rng_triton`,
computes the same numbers inside kernels.

PyTorch has no full uint32 arithmetic, so the torch side keeps values in int64 and
splits each 32x32-bit product into 16-bit halves to stay exact without overflow.
"""

import torch

MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x846CA68B
SEED_SALT = 0x9E3779B9
INV_2POW24 = 1.0 / 16777216.0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL_B)
    return x ^ (x >> 16)


def seed_key(seeds: torch.Tensor) -> torch.Tensor:
    """Per-request 32-bit key from an int64 seed (both halves are used)."""
    seeds = seeds.to(torch.int64)
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    return mix32(hi ^ mix32(lo ^ SEED_SALT))


def step_key(key: torch.Tensor, step: int) -> torch.Tensor:
    return mix32(key ^ step)


def gumbel(key: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise for every (row key, vocabulary index) pair: [R] x [V] -> [R, V]."""
    h = mix32(key[:, None] ^ vocab[None, :].to(torch.int64))
    u = ((h >> 8).to(torch.float32) + 0.5) * INV_2POW24
    return -torch.log(-torch.log(u))
