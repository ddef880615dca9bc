"""Survival-ranked admission: how many draft tokens of each request to verify.

Given conditional confidences c[r, j] and a token budget, the scheduler verifies the
global top-`budget` slots (r, j) ranked by prefix survival a[r, j] = prod_{i<=j} c[r, i].
The total order is: a descending, then j ascending, then r ascending. Only slots with
a > 0 are eligible (a zero-survival token is never worth verifying). Because a is
non-increasing along j, the selection is prefix-closed per request and is returned as
lengths[r]. Survival is computed in float64 on both paths so that ties are decided on
the same numbers.
"""

from typing import Optional

import torch
import triton
import triton.language as tl


def _validate(conf: torch.Tensor, budget: int) -> None:
    if conf.dim() != 2:
        raise ValueError(f"confidences must be [R, K], got {tuple(conf.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")


def survival(conf: torch.Tensor) -> torch.Tensor:
    """Prefix products in float64, multiplied strictly left to right.

    torch.cumprod may use a parallel scan on GPU, whose rounding differs; the kernel and
    the NumPy policy both multiply sequentially, so ties resolve identically.
    """
    cols = [conf[:, 0].to(torch.float64)] if conf.shape[1] else []
    for j in range(1, conf.shape[1]):
        cols.append(cols[-1] * conf[:, j].to(torch.float64))
    return torch.stack(cols, dim=1) if cols else conf.to(torch.float64)


def admission_lengths_reference(conf: torch.Tensor, budget: int) -> torch.Tensor:
    """PyTorch path: a stable sort of the flattened slots in the tie order."""
    _validate(conf, budget)
    num_req, k = conf.shape
    surv = survival(conf)
    # Flatten column-major (j outer, r inner) so a stable descending sort on a alone
    # yields ties ordered by j ascending, then r ascending.
    flat = surv.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    chosen = order[: min(budget, flat.numel())]
    chosen = chosen[flat[chosen] > 0]
    lengths = torch.zeros(num_req, dtype=torch.int64, device=conf.device)
    lengths.index_add_(0, chosen % num_req, torch.ones_like(chosen))
    return lengths


@triton.jit
def _admission_kernel(
    conf_ptr, out_ptr, budget, num_req, k, stride_r,
    K_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per request: rank each of its slots against all slots, count ranks < budget."""
    r = tl.program_id(0)
    offs_j = tl.arange(0, K_PAD)
    mask_j = offs_j < k
    mine = tl.zeros([K_PAD], dtype=tl.float64)
    run = tl.full([], 1.0, tl.float64)
    for i in range(0, k):
        run = run * tl.load(conf_ptr + r * stride_r + i).to(tl.float64)
        mine = tl.where(offs_j == i, run, mine)
    rank = tl.zeros([K_PAD], dtype=tl.int32)
    total = num_req * k
    for start in range(0, total, BLOCK):
        # Other slots enumerated row-major: s = r' * k + j'.
        offs_s = start + tl.arange(0, BLOCK)
        mask_s = offs_s < total
        other_r = offs_s // k
        other_j = offs_s % k
        # Survival of each other slot: product of its row prefix (k is small, loop over it).
        other = tl.full([BLOCK], 1.0, tl.float64)
        for i in range(0, k):
            ci = tl.load(conf_ptr + other_r * stride_r + i, mask=mask_s & (i <= other_j), other=1.0)
            other = other * ci.to(tl.float64)
        a_o = other[None, :]
        a_m = mine[:, None]
        j_o = other_j[None, :]
        j_m = offs_j[:, None]
        before = (a_o > a_m) | ((a_o == a_m) & ((j_o < j_m) | ((j_o == j_m) & (other_r[None, :] < r))))
        before = before & mask_s[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
    selected = (rank < budget) & (mine > 0) & mask_j
    tl.store(out_ptr + r, tl.sum(selected.to(tl.int64), axis=0))


def admission_lengths_triton(conf: torch.Tensor, budget: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton path: O((R*K)^2) pairwise ranking, exact and free of sorts and atomics.

    Fine for the few thousand slots of a decode batch; `out` is an optional int64 [R] buffer.
    """
    _validate(conf, budget)
    conf = conf.contiguous()
    num_req, k = conf.shape
    if out is None:
        out = torch.empty(num_req, dtype=torch.int64, device=conf.device)
    if num_req == 0:
        return out
    if k == 0:
        return out.zero_()
    _admission_kernel[(num_req,)](
        conf, out, budget, num_req, k, conf.stride(0),
        K_PAD=triton.next_power_of_2(k), BLOCK=256,
    )
    return out
