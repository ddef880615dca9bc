"""Verification of a chain of draft tokens (DSPARK.md section 1), as pure tensor functions.

Both functions take a batch of N independent rounds and return, per round, how many draft
tokens the target accepted (0..K) and the one token the target adds after them (the
resampled token on a rejection, the bonus token on full acceptance). Kept free of models
and state so the lossless property can be tested on its own with known distributions.
"""

from __future__ import annotations

import torch


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft equals the target's argmax, then emit the
    target's argmax at the first mismatch (or after the last draft).

    draft_tokens: [N, K]; target_logits: [N, K + 1, V], row k is the target's prediction
    for the token after the anchor and draft tokens 1..k.
    """
    k = draft_tokens.shape[1]
    choice = target_logits.argmax(-1)
    accepted = (draft_tokens == choice[:, :k]).long().cumprod(-1).sum(-1)
    return accepted, choice.gather(1, accepted.unsqueeze(1)).squeeze(1)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling: accept x_k with probability min(1, p_t(x_k) / p_d(x_k)),
    stop at the first rejection and resample there from the normalised max(0, p_t - p_d);
    on full acceptance draw the bonus token from p_t. The output then follows p_t exactly.

    draft_tokens: [N, K] sampled from draft_probs [N, K, V]; target_probs: [N, K + 1, V]
    (row k conditioned on the anchor and draft tokens 1..k, like the draft rows).
    """
    n, k = draft_tokens.shape
    index = draft_tokens.unsqueeze(-1)
    p_target = target_probs[:, :k].gather(-1, index).squeeze(-1)
    p_draft = draft_probs.gather(-1, index).squeeze(-1)
    uniform = torch.rand(n, k, generator=generator, device=draft_tokens.device, dtype=p_target.dtype)
    # u * p_d < p_t has probability exactly min(1, p_t / p_d) for u ~ U[0, 1).
    accepted = (uniform * p_draft < p_target).long().cumprod(-1).sum(-1)
    rows = torch.arange(n, device=draft_tokens.device)
    target_row = target_probs[rows, accepted]
    # After full acceptance the "draft row" is zero, so the residual is p_t itself.
    draft_row = torch.cat([draft_probs, draft_probs.new_zeros(n, 1, draft_probs.shape[-1])], 1)[rows, accepted]
    residual = (target_row - draft_row).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # Zero mass means p_t == p_d on the rejected row, where rejection has probability 0;
    # only rounding can get here, and p_t is then the exact residual distribution.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target_row)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted, next_token
