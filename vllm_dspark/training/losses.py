"""DSpark training losses (DSPARK.md section 2), one small function each.

All per-position terms are weighted by w_k = exp(-(k-1)/gamma) for block positions
k = 1..gamma, because an early mistake ends the accepted prefix and makes later positions
matter less. Shapes: N blocks, K positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_dspark.training.soft_labels import TopKProbs


@dataclass(frozen=True)
class LossWeights:
    """total = ce * CE + tv * TV + conf * BCE (the paper's 0.1 / 0.9 / 1.0)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0


def position_weights(block_size: int, device: torch.device | None = None) -> torch.Tensor:
    """[K] w_k = exp(-(k-1)/gamma), k = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / block_size)


def total_variation_l1(draft_probs: torch.Tensor, target: TopKProbs) -> torch.Tensor:
    """||p_d - p_t||_1 over the last axis (twice the total-variation distance), in [0, 2],
    from the target's top k: exact on the k kept tokens, and q_out + r outside them (q_out
    the draft's mass there, r the target's). The true outside sum lies in
    [|q_out - r|, q_out + r], so this is an upper bound, too large by at most
    2 min(q_out, r) <= 2 r, and exact for k = V. The acceptance label 1 - TV/2 is then a
    lower bound, too small by at most min(q_out, r) <= r. A kept token with id -1 (one a
    reduced draft vocabulary lacks) has draft probability 0, so it stays exact."""
    q_top = draft_probs.gather(-1, target.ids.clamp_min(0)) * (target.ids >= 0)
    q_out = (1.0 - q_top.sum(-1)).clamp_min(0.0)
    return (q_top - target.probs).abs().sum(-1) + q_out + target.rest


def acceptance_label(tv_l1: torch.Tensor) -> torch.Tensor:
    """Soft label c* = 1 - 0.5 ||p_d - p_t||_1: the exact probability that rejection
    sampling accepts a token drawn from p_d. Detached: the confidence head must follow
    the drafter, not pull the drafter towards its own prediction."""
    return (1.0 - 0.5 * tv_l1).detach().clamp(0.0, 1.0)


def supervision_weights(row_weights: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, K] weight of each supervised position: block weight [N] (0 = padding) times w_k.
    Their sum is the denominator of every loss term."""
    return row_weights.unsqueeze(-1) * position_weights(block_size, row_weights.device)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """sum(values * weights) / denominator, for values and weights [N, K]."""
    return (values * weights).sum() / denominator.clamp_min(1e-12)


def dspark_losses(
    logits: torch.Tensor,
    target: TopKProbs,
    targets: torch.Tensor,
    conf_logits: torch.Tensor | None,
    row_weights: torch.Tensor,
    weights: LossWeights = LossWeights(),
    denominator: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The three losses and their weighted total.

    logits: draft logits [N, K, V] over the drafter's vocabulary; target: p_t's top k
    [N, K, k] in the same ids; targets: ground-truth next tokens [N, K] (-1: outside a
    reduced draft vocabulary); conf_logits: raw confidence logits [N, K] (None without a confidence
    head); row_weights: [N]; denominator: what the weighted sums are divided by, by default
    this batch's total supervision weight (a mean over its positions); data-parallel
    training passes a global one (`distributed.data_parallel_denominator`). Returns scalars
    "ce", "tv", "conf", "total" and the per-block acceptance label "accept" [N, K]
    (detached; for logging and calibration).
    """
    sup_w = supervision_weights(row_weights, logits.shape[1])
    if denominator is None:
        denominator = sup_w.sum()
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    target_log_probs = log_probs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    # A target token outside a reduced draft vocabulary (-1) has no CE term (the drafter
    # cannot learn to emit it); TV still charges the mass the drafter cannot reach.
    ce = torch.where(targets >= 0, -target_log_probs, 0.0)
    tv = total_variation_l1(log_probs.exp(), target)
    accept = acceptance_label(tv)
    losses = {
        "ce": weighted_mean(ce, sup_w, denominator),
        "tv": weighted_mean(tv, sup_w, denominator),
    }
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
        losses["conf"] = weighted_mean(bce, sup_w, denominator)
    else:
        losses["conf"] = torch.zeros((), device=logits.device)  # fp32 like the others, also under autocast
    losses["total"] = weights.ce * losses["ce"] + weights.tv * losses["tv"] + weights.conf * losses["conf"]
    losses["accept"] = accept
    return losses
