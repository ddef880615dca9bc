"""Fused sequential drafting head (vanilla low-rank Markov) with confidence.

For R requests and K steps: logits_k = U[:, k] + W2 @ W1[x_{k-1}] (x_0 = anchor), then
greedy (temperature 0) or Gumbel-max sampling at the request's temperature, with noise
from `rng` so the kernel picks the same tokens as its reference, the model's
`vllm_dspark.model.heads.sequential_draft`. Per step it reports the chosen token, its
exact draft probability (softmax at T; 1 for greedy rows, whose draft distribution is the
point mass at the argmax) and the confidence
c_k = sigmoid((w_h . h_k + w_m . W1[x_{k-1}] + b) / T_conf[k]). Optionally the full draft
distribution rows are written, which rejection sampling at T > 0 needs.

Reduced draft vocabulary: U and W2 cover the V_draft draft ids, W1 the target vocabulary,
and `draft_to_target` maps each chosen draft id to its target id, which is what the next
step's W1 row and the returned tokens are; draft rows come back over the target
vocabulary, zero outside the subset, as the reference returns them.

Each program owns BLOCK_R requests and one contiguous vocabulary split, walks it in tiles
with an online softmax and Gumbel-max, and shares every W2 tile among its BLOCK_R requests
through a tensor-core product. One launch per step (K + 1 in all) merges the previous
step's per-split partials, since the next token needs the whole vocabulary.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from vllm_dspark.model.heads import DraftOutput

from .rng_triton import gumbel_tl, seed_key_tl, step_key_tl


def check_inputs(base_logits, anchor, w1, w2, hidden, conf_weight, conf_temps, temperature, seeds,
                 draft_to_target=None):
    """Shapes the kernel needs; the dispatcher checks them for its reference path too, so
    a caller's mistake shows on CPU, not first on a GPU."""
    num_req, k, vocab = base_logits.shape
    rank = w1.shape[1]
    if draft_to_target is None:
        if w1.shape != (vocab, rank) or w2.shape != (vocab, rank):
            raise ValueError(f"w1/w2 must both be [V={vocab}, r], got {tuple(w1.shape)}, {tuple(w2.shape)}")
    else:
        if draft_to_target.shape != (vocab,):
            raise ValueError(f"draft_to_target must be [V_draft={vocab}], got {tuple(draft_to_target.shape)}")
        if w2.shape != (vocab, rank) or w1.shape[0] < vocab:
            raise ValueError(f"w2 must be [V_draft={vocab}, r] and w1 [V_target, r], got {tuple(w2.shape)}, "
                             f"{tuple(w1.shape)}")
    for name, t in (("anchor", anchor), ("temperature", temperature), ("seeds", seeds)):
        if t.shape != (num_req,):
            raise ValueError(f"{name} must be [R={num_req}], got {tuple(t.shape)}")
    if conf_weight is not None:
        if hidden is None or hidden.shape[:2] != (num_req, k):
            raise ValueError("a confidence head needs hidden states [R, K, d]")
        d = hidden.shape[2]
        if conf_weight.shape not in ((d,), (d + rank,)):
            raise ValueError(f"confidence weight must be [d] or [d + r], got {tuple(conf_weight.shape)}")
        if conf_temps is not None and conf_temps.shape != (k,):
            raise ValueError(f"conf_temps must be [K={k}], got {tuple(conf_temps.shape)}")


@triton.jit
def _combine_splits(pf_ptr, pi_ptr, buf, rows, rmask, num_req, num_splits, SPLITS_PAD: tl.constexpr):
    """Merge per-split (max, sum, best score, logit at best, index at best) of one step.

    Splits are contiguous vocabulary ranges in order, so the first maximal split holds the
    smallest winning index: the same tie rule as torch.argmax.
    """
    offs_s = tl.arange(0, SPLITS_PAD)
    m2 = rmask[:, None] & (offs_s < num_splits)[None, :]
    plane = num_req * num_splits
    at = rows[:, None] * num_splits + offs_s[None, :]
    f_base = pf_ptr + buf * 4 * plane
    # Rows past the batch get a harmless (max 0, sum 1) so no inf - inf is ever formed.
    p_max = tl.where(rmask[:, None], tl.load(f_base + at, mask=m2, other=float("-inf")), 0.0)
    p_sum = tl.where(rmask[:, None], tl.load(f_base + plane + at, mask=m2, other=0.0), 1.0)
    p_best = tl.load(f_base + 2 * plane + at, mask=m2, other=float("-inf"))
    p_logit = tl.load(f_base + 3 * plane + at, mask=m2, other=0.0)
    p_idx = tl.load(pi_ptr + buf * plane + at, mask=m2, other=0)
    g_max = tl.max(p_max, axis=1)
    g_sum = tl.sum(p_sum * tl.exp(p_max - g_max[:, None]), axis=1)
    win = tl.argmax(p_best, axis=1)
    hit = offs_s[None, :] == win[:, None]
    token = tl.sum(tl.where(hit, p_idx, 0), axis=1)
    logit = tl.sum(tl.where(hit, p_logit, 0.0), axis=1)
    return token, logit, g_max, g_sum


@triton.jit
def _sequential_head_step_kernel(
    u_ptr, anchor_ptr, w1_ptr, w2_ptr, temp_ptr, seed_ptr, d2t_ptr,
    h_ptr, cw_ptr, ct_ptr, conf_bias,
    tok_ptr, tp_ptr, conf_ptr, probs_ptr, pf_ptr, pi_ptr,
    step, num_req, k_steps, vocab, rank, hid, split_len, num_splits,
    s_ur, s_uk, s_w1, s_w2, s_hr, s_hk, s_pr, s_pk,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, R_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr, HAS_CONF: tl.constexpr, CONF_MARKOV: tl.constexpr,
    WRITE_PROBS: tl.constexpr, HAS_D2T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Launch `step` (0..K) over (request tile, vocabulary split).

    It first finishes step-1 from the partials that launch left (token, its probability,
    normalised probability rows of this split), then, if step < K, computes step's
    partials over this split. Partials are double-buffered by step parity. Greedy rows
    get probability 1 and one-hot rows: their token is not drawn from the softmax. With
    HAS_D2T the partials hold draft ids, mapped to target ids for the token and W1.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    rmask = rows < num_req
    v_lo = split * split_len
    v_hi = tl.minimum(v_lo + split_len, vocab)
    temp = tl.load(temp_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    sampled = temp > 0
    if step == 0:
        prev = tl.load(anchor_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        chosen, logit, g_max, g_sum = _combine_splits(pf_ptr, pi_ptr, (step - 1) % 2, rows, rmask,
                                                      num_req, num_splits, SPLITS_PAD)
        if HAS_D2T:
            prev = tl.load(d2t_ptr + chosen, mask=rmask, other=0).to(tl.int64)
        else:
            prev = chosen
        if split == 0:
            tl.store(tok_ptr + rows * k_steps + step - 1, prev, mask=rmask)
            tl.store(tp_ptr + rows * k_steps + step - 1, tl.where(sampled, tl.exp(logit - g_max) / g_sum, 1.0),
                     mask=rmask)
        if WRITE_PROBS:
            for v0 in range(v_lo, v_hi, BLOCK_V):
                offs_v = v0 + tl.arange(0, BLOCK_V)
                pmask = rmask[:, None] & (offs_v < v_hi)[None, :]
                pp = probs_ptr + rows[:, None] * s_pr + (step - 1) * s_pk + offs_v[None, :]
                lg = tl.load(pp, mask=pmask & sampled[:, None], other=0.0)
                one_hot = (offs_v[None, :] == chosen[:, None]).to(tl.float32)
                tl.store(pp, tl.where(sampled[:, None], tl.exp(lg - g_max[:, None]) / g_sum[:, None], one_hot),
                         mask=pmask)
    if step < k_steps:
        inv_t = 1.0 / tl.where(sampled, temp, 1.0)
        key = seed_key_tl(tl.load(seed_ptr + rows, mask=rmask, other=0).to(tl.int64))
        kkey = step_key_tl(key, tl.zeros([BLOCK_R], dtype=tl.uint32) + step)
        offs_r = tl.arange(0, R_PAD)
        rank_mask = offs_r < rank
        emb = tl.load(w1_ptr + prev[:, None] * s_w1 + offs_r[None, :], mask=rank_mask[None, :], other=0.0)
        if HAS_CONF:
            if split == 0:
                z = tl.zeros([BLOCK_R], dtype=tl.float32)
                for d0 in range(0, hid, BLOCK_D):
                    offs_d = d0 + tl.arange(0, BLOCK_D)
                    dmask = offs_d < hid
                    hk = tl.load(h_ptr + rows[:, None] * s_hr + step * s_hk + offs_d[None, :],
                                 mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                    wd = tl.load(cw_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
                    z += tl.sum(hk * wd[None, :], axis=1)
                if CONF_MARKOV:
                    wm = tl.load(cw_ptr + hid + offs_r, mask=rank_mask, other=0.0).to(tl.float32)
                    z += tl.sum(emb.to(tl.float32) * wm[None, :], axis=1)
                t_conf = tl.load(ct_ptr + step).to(tl.float32)
                conf = 1.0 / (1.0 + tl.exp(-((z + conf_bias) / t_conf)))
                tl.store(conf_ptr + rows * k_steps + step, conf, mask=rmask)
        run_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        best = tl.full([BLOCK_R], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_R], dtype=tl.int64)
        best_logit = tl.zeros([BLOCK_R], dtype=tl.float32)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            vmask = offs_v < v_hi
            w2t = tl.load(w2_ptr + offs_v[None, :] * s_w2 + offs_r[:, None],
                          mask=rank_mask[:, None] & vmask[None, :], other=0.0)
            bias = tl.dot(emb, w2t, input_precision=DOT_PRECISION)
            base = tl.load(u_ptr + rows[:, None] * s_ur + step * s_uk + offs_v[None, :],
                           mask=rmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
            logits = tl.where(vmask[None, :], (base + bias) * inv_t[:, None], float("-inf"))
            if WRITE_PROBS:
                tl.store(probs_ptr + rows[:, None] * s_pr + step * s_pk + offs_v[None, :], logits,
                         mask=(rmask & sampled)[:, None] & vmask[None, :])
            new_max = tl.maximum(run_max, tl.max(logits, axis=1))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
            run_max = new_max
            score = tl.where(sampled[:, None], logits + gumbel_tl(kkey, offs_v), logits)
            tile_best = tl.max(score, axis=1)
            tile_arg = v0 + tl.argmax(score, axis=1)
            tile_logit = tl.sum(tl.where(offs_v[None, :] == tile_arg[:, None], logits, 0.0), axis=1)
            upd = tile_best > best
            best = tl.where(upd, tile_best, best)
            best_idx = tl.where(upd, tile_arg.to(tl.int64), best_idx)
            best_logit = tl.where(upd, tile_logit, best_logit)
        plane = num_req * num_splits
        at = rows * num_splits + split
        f_base = pf_ptr + (step % 2) * 4 * plane
        tl.store(f_base + at, run_max, mask=rmask)
        tl.store(f_base + plane + at, run_sum, mask=rmask)
        tl.store(f_base + 2 * plane + at, best, mask=rmask)
        tl.store(f_base + 3 * plane + at, best_logit, mask=rmask)
        tl.store(pi_ptr + (step % 2) * plane + at, best_idx, mask=rmask)


def sequential_head_triton(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    hidden: Optional[torch.Tensor] = None,
    conf_weight: Optional[torch.Tensor] = None,
    conf_bias: float = 0.0,
    conf_temps: Optional[torch.Tensor] = None,
    return_probs: bool = False,
    block_r: int = 16,
    block_v: Optional[int] = None,
    num_splits: Optional[int] = None,
    out: Optional[DraftOutput] = None,
    draft_to_target: Optional[torch.Tensor] = None,
    target_vocab: Optional[int] = None,
) -> DraftOutput:
    """Triton path of `dispatch.sequential_head`; its reference is the model's
    `sequential_draft` on `vanilla_heads(w1, w2, d, conf_weight, conf_bias)`.

    K + 1 launches over (request tile, vocabulary split): the next token needs the whole
    vocabulary, and a grid-wide barrier inside one launch could deadlock, so each launch
    merges the previous step's per-split partials. `num_splits` defaults to about twice
    the GPU's SM count over the request tiles.

    `out` supplies preallocated output buffers (its `probs` must be given exactly when
    `return_probs`, over the draft vocabulary); without a confidence head the confidences
    are all 1. With `draft_to_target` [V_draft] (reduced vocabulary) the returned rows are
    widened to `target_vocab` (default: W1's rows).
    """
    check_inputs(base_logits, anchor, w1, w2, hidden, conf_weight, conf_temps, temperature, seeds, draft_to_target)
    num_req, k_steps, vocab = base_logits.shape
    rank = w1.shape[1]
    dev = base_logits.device
    if base_logits.stride(2) != 1:
        base_logits = base_logits.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    has_conf = conf_weight is not None
    if out is None:
        out = DraftOutput(
            tokens=torch.empty(num_req, k_steps, dtype=torch.int64, device=dev),
            token_probs=torch.empty(num_req, k_steps, dtype=torch.float32, device=dev),
            confidences=torch.empty(num_req, k_steps, dtype=torch.float32, device=dev),
            probs=torch.empty(num_req, k_steps, vocab, dtype=torch.float32, device=dev) if return_probs else None,
        )
    elif (out.probs is not None) != return_probs:
        raise ValueError("`out` must hold a probs buffer exactly when return_probs is set")
    if not has_conf:
        out.confidences.fill_(1.0)
    if num_req == 0 or k_steps == 0:
        return out
    probs = out.probs
    if has_conf:
        hidden = hidden.contiguous()
        hid = hidden.shape[2]
        if conf_temps is None:
            conf_temps = torch.ones(k_steps, dtype=torch.float32, device=dev)
        h_arg, cw_arg, ct_arg = hidden, conf_weight.contiguous(), conf_temps.contiguous()
        s_hr, s_hk = hidden.stride(0), hidden.stride(1)
    else:
        hid, s_hr, s_hk = 0, 0, 0
        h_arg = cw_arg = ct_arg = out.token_probs  # never read
    r_pad = max(16, triton.next_power_of_2(rank))
    if block_v is None:  # a W2 tile of at most 64 KiB
        block_v = min(128, max(16, 65536 // (r_pad * w2.element_size())))
    row_tiles = triton.cdiv(num_req, block_r)
    if num_splits is None:
        # Enough programs to fill the GPU about twice; W2 is then read once per row tile.
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        num_splits = triton.cdiv(2 * sms, row_tiles)
    split_len = triton.cdiv(triton.cdiv(vocab, max(1, min(num_splits, vocab))), block_v) * block_v
    num_splits = triton.cdiv(vocab, split_len)
    part_f = torch.empty(2, 4, num_req, num_splits, dtype=torch.float32, device=dev)
    part_i = torch.empty(2, num_req, num_splits, dtype=torch.int64, device=dev)
    has_d2t = draft_to_target is not None
    d2t_arg = draft_to_target.contiguous() if has_d2t else anchor  # never read without it
    for step in range(k_steps + 1):
        _sequential_head_step_kernel[(row_tiles, num_splits)](
            base_logits, anchor, w1, w2, temperature, seeds, d2t_arg,
            h_arg, cw_arg, ct_arg, float(conf_bias),
            out.tokens, out.token_probs, out.confidences, out.token_probs if probs is None else probs,
            part_f, part_i,
            step, num_req, k_steps, vocab, rank, hid, split_len, num_splits,
            base_logits.stride(0), base_logits.stride(1), w1.stride(0), w2.stride(0), s_hr, s_hk,
            probs.stride(0) if return_probs else 0, probs.stride(1) if return_probs else 0,
            BLOCK_R=block_r, BLOCK_V=block_v, R_PAD=r_pad,
            BLOCK_D=min(256, triton.next_power_of_2(max(hid, 16))),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_CONF=has_conf, CONF_MARKOV=has_conf and conf_weight.shape[0] > hid,
            WRITE_PROBS=return_probs, HAS_D2T=has_d2t,
            DOT_PRECISION="ieee" if w1.dtype == torch.float32 else "tf32",
        )
    if has_d2t and probs is not None:
        wide = torch.zeros(num_req, k_steps, target_vocab or w1.shape[0], dtype=torch.float32, device=dev)
        wide[:, :, draft_to_target] = probs
        out.probs = wide
    return out
