"""Verification attention over a paged KV cache, for draft chains and draft trees.

The verification tokens of R requests are flattened into one query sequence
(`cu_seqlens_q`, int32 [R+1]; a request may have 0 tokens). Each token attends to its
request's cached context (`context_lens[r]` tokens, read through `block_table` from
`key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim]`) and to the
new tokens' own keys/values (`k_new/v_new: [total_q, num_kv_heads, head_dim]`):
- chain (`tree_parents=None`): new token i sees new tokens 0..i;
- tree: `tree_parents` (int32 [total_q], request-local parent index, -1 for a root) and a
  token sees itself and its ancestors only.

The kernel launches once for all requests: grid (request, kv head, query tile). The
query tile stacks (token, q head) pairs of one KV group, so each K/V tile is loaded
once for all GROUP query heads that share it, and a request only gets as many tiles
as its own tokens need (tiles past its length exit at once).
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl


def _validate(q, k_new, v_new, key_cache, value_cache, block_table, context_lens, cu_seqlens_q, tree_parents):
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_new.shape != (total_q, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError("k_new/v_new must be [total_q, num_kv_heads, head_dim]")
    if key_cache.shape[3] != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError("key/value caches must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if len({t.dtype for t in (q, k_new, v_new, key_cache, value_cache)}) != 1:
        raise ValueError("q, k_new, v_new and the caches must share one dtype")
    num_req = cu_seqlens_q.shape[0] - 1
    if block_table.shape[0] != num_req or context_lens.shape != (num_req,):
        raise ValueError("block_table and context_lens need one row per request")
    if tree_parents is not None and tree_parents.shape != (total_q,):
        raise ValueError("tree_parents must be [total_q]")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n] request-local parent indices -> [n, n] bool, mask[i, j] = j is i or an ancestor of i."""
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    mask = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    mask[idx, idx] = True
    cur = idx
    for _ in range(n):  # a path is at most n nodes long
        live = cur >= 0
        cur = torch.where(live, parents[cur.clamp(min=0)].to(idx.dtype), cur)
        live = cur >= 0
        mask[idx[live], cur[live]] = True
    return mask


def verify_attention_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    tree_parents: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """PyTorch path, one request at a time; returns [total_q, num_q_heads, head_dim] in q.dtype."""
    _validate(q, k_new, v_new, key_cache, value_cache, block_table, context_lens, cu_seqlens_q, tree_parents)
    total_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for r in range(len(cu) - 1):
        start, end, ctx = cu[r], cu[r + 1], ctx_lens[r]
        n = end - start
        if n == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        blocks = block_table[r, pos // block_size].long()
        keys = torch.cat([key_cache[blocks, pos % block_size], k_new[start:end]], dim=0)
        vals = torch.cat([value_cache[blocks, pos % block_size], v_new[start:end]], dim=0)
        if tree_parents is None:
            own = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            own = ancestor_mask(tree_parents[start:end])
        allowed = torch.cat([torch.ones(n, ctx, dtype=torch.bool, device=q.device), own], dim=1)
        # [Hkv, group, n, D] x [Hkv, D, ctx+n] -> [Hkv, group, n, ctx+n]
        qr = q[start:end].to(compute_dtype).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        kr = keys.to(compute_dtype).permute(1, 2, 0)[:, None]
        vr = vals.to(compute_dtype).permute(1, 0, 2)[:, None]
        scores = (qr @ kr) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ vr
        out[start:end] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)
    return out


@triton.jit
def _online_update(scores, vals, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One flash-attention step on log2-scaled scores; rows with nothing allowed stay at zero."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _verify_attention_kernel(
    q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, cu_ptr, par_ptr, out_ptr,
    qk_scale, block_size, head_dim,
    s_qt, s_qh, s_knt, s_knh, s_vnt, s_vnh,
    s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_bt, s_ot, s_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    IS_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_ptr + r)
    n_q = tl.load(cu_ptr + r + 1) - q_start
    if tile * BLOCK_M < n_q * GROUP:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        mmask = tok < n_q
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < head_dim
        qmask = mmask[:, None] & dmask[None, :]
        qt = tl.load(q_ptr + (q_start + tok)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                     mask=qmask, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

        ctx = tl.load(ctx_ptr + r)
        for n0 in range(0, ctx, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            nmask = pos < ctx
            blk = tl.load(bt_ptr + r * s_bt + pos // block_size, mask=nmask, other=0).to(tl.int64)
            off = pos % block_size
            kvmask = nmask[:, None] & dmask[None, :]
            kt = tl.load(kc_ptr + blk[:, None] * s_kcb + off[:, None] * s_kcs + kvh * s_kch + offs_d[None, :],
                         mask=kvmask, other=0.0)
            vt = tl.load(vc_ptr + blk[:, None] * s_vcb + off[:, None] * s_vcs + kvh * s_vch + offs_d[None, :],
                         mask=kvmask, other=0.0)
            scores = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale
            scores = tl.where(nmask[None, :], scores, float("-inf"))
            m_i, l_i, acc = _online_update(scores, vt, m_i, l_i, acc, DOT_PRECISION)

        for n0 in range(0, n_q, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            jmask = j < n_q
            kvmask = jmask[:, None] & dmask[None, :]
            kt = tl.load(kn_ptr + (q_start + j)[:, None] * s_knt + kvh * s_knh + offs_d[None, :],
                         mask=kvmask, other=0.0)
            vt = tl.load(vn_ptr + (q_start + j)[:, None] * s_vnt + kvh * s_vnh + offs_d[None, :],
                         mask=kvmask, other=0.0)
            scores = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale
            if IS_TREE:
                # Walk every query's path to its root; a path has at most n_q nodes.
                allowed = tok[:, None] == j[None, :]
                cur = tok
                for _ in range(0, n_q):
                    cur = tl.load(par_ptr + q_start + cur, mask=mmask & (cur >= 0), other=-1)
                    allowed = allowed | (cur[:, None] == j[None, :])
            else:
                allowed = j[None, :] <= tok[:, None]
            scores = tl.where(allowed & jmask[None, :], scores, float("-inf"))
            m_i, l_i, acc = _online_update(scores, vt, m_i, l_i, acc, DOT_PRECISION)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)


def verify_attention_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    tree_parents: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    max_q: Optional[int] = None,
    block_n: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton path. Pass `max_q` (longest request) to avoid a device-to-host sync, and
    `out` (shaped like q) to write into a preallocated buffer."""
    _validate(q, k_new, v_new, key_cache, value_cache, block_table, context_lens, cu_seqlens_q, tree_parents)
    total_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_req = cu_seqlens_q.shape[0] - 1
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    if max_q is None:
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_req else 0
    if num_req == 0 or max_q == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(max_q * group)))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:  # keeps fp32 at head size 256 within the SM's shared memory
        block_n = 64 if d_pad * q.element_size() <= 512 else 32
    grid = (num_req, num_kv_heads, triton.cdiv(max_q * group, block_m))
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    parents = tree_parents if tree_parents is not None else cu_seqlens_q  # never read for chains
    _verify_attention_kernel[grid](
        q, k_new, v_new, key_cache, value_cache, block_table, context_lens, cu_seqlens_q, parents, out,
        scale * math.log2(math.e), block_size, head_dim,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad,
        IS_TREE=tree_parents is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
