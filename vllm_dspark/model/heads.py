"""The sequential stage of DSpark: Markov heads and the confidence head (DSPARK.md section 1).

Every head is a step function `(previous token, backbone hidden h_k, state) -> (bias over
the vocabulary, Markov feature W1[x_{k-1}], new state)`, so the drafting loop, training
with teacher forcing and the serving proposer all run the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_dspark.config import DrafterConfig
from vllm_dspark.kernels.rng import gumbel, seed_key, step_key

HeadState = torch.Tensor | None


class MarkovHead(nn.Module):
    """Vanilla low-rank transition: B_k = W2(W1[x_{k-1}])."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, self.rank)
        self.markov_w2 = nn.Linear(self.rank, config.draft_vocab, bias=False)

    def initial_state(self, batch: int, like: torch.Tensor) -> HeadState:
        return None

    def transition_input(
        self, feature: torch.Tensor, hidden: torch.Tensor, state: HeadState
    ) -> tuple[torch.Tensor, HeadState]:
        """What W2 is applied to, and the next state."""
        return feature, state

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: HeadState
    ) -> tuple[torch.Tensor, torch.Tensor, HeadState]:
        feature = self.markov_w1(prev_tokens)
        w2_input, state = self.transition_input(feature, hidden, state)
        return self.markov_w2(w2_input), feature, state


class GatedMarkovHead(MarkovHead):
    """B_k = W2(g * W1[x_{k-1}]), g = sigmoid(Linear([h_k ; W1[x_{k-1}]]))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size + self.rank, self.rank)

    def transition_input(
        self, feature: torch.Tensor, hidden: torch.Tensor, state: HeadState
    ) -> tuple[torch.Tensor, HeadState]:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, feature], -1)))
        return gate * feature, state


class RnnMarkovHead(MarkovHead):
    """Gated recurrent state over the block: s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.joint_proj = nn.Linear(2 * self.rank + config.hidden_size, 3 * self.rank)

    def initial_state(self, batch: int, like: torch.Tensor) -> HeadState:
        return like.new_zeros(batch, self.rank)

    def transition_input(
        self, feature: torch.Tensor, hidden: torch.Tensor, state: HeadState
    ) -> tuple[torch.Tensor, HeadState]:
        assert state is not None
        gate, candidate, output = self.joint_proj(
            torch.cat([state, feature, hidden], -1)
        ).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        state = keep * state + (1 - keep) * torch.tanh(candidate)
        return torch.tanh(output), state


MARKOV_HEADS: dict[str, type[MarkovHead]] = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RnnMarkovHead,
}


def build_markov_head(config: DrafterConfig) -> MarkovHead | None:
    if not config.has_markov_head:
        return None
    return MARKOV_HEADS[config.markov_head_type](config)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid((w . [h_k ; W1[x_{k-1}]] + b) / T_k), T_k from calibration."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov and config.has_markov_head
        in_size = config.hidden_size + (config.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(in_size, 1)

    def logit(self, hidden: torch.Tensor, markov_feature: torch.Tensor | None) -> torch.Tensor:
        features = torch.cat([hidden, markov_feature], -1) if self.with_markov else hidden
        return self.proj(features).squeeze(-1)


@dataclass
class DraftOutput:
    """One drafted block per request, from `sequential_draft` or the fused kernel.

    Each draft row is exactly the distribution its token was drawn from: softmax at the
    request's temperature for sampled rows, the point mass at the argmax for greedy ones,
    which is what rejection sampling must be given. Positions past a request's `depths`
    were not drafted (early stop): token 0 with a point-mass row and confidence 0, so no
    policy verifies them, and verifying one anyway would still be exact.
    """

    tokens: torch.Tensor  # [N, K] int64
    token_probs: torch.Tensor  # [N, K] float32, draft probability of each token (1 when greedy)
    confidences: torch.Tensor  # [N, K] float32 calibrated conditional survival c_k (1 without a head)
    probs: torch.Tensor | None  # [N, K, V] float32 draft rows, when requested
    depths: torch.Tensor | None = None  # [N] positions drafted per request (None: all K)
    lm_head_rows: int | None = None  # (request, position) rows whose logits were computed


# Base logits U_k: a precomputed [N, K, V] tensor, or a function (rows [n], position j) ->
# [n, V] that computes only the rows still drafting (the LM head, position by position).
BaseLogits = torch.Tensor | Callable[[torch.Tensor, int], torch.Tensor]


def draft_seeds(n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh sampler seeds [n] int64 over the whole int64 range (the noise keys on both
    32-bit halves), drawn from `generator` or torch's default generator."""
    where = device if generator is None else generator.device
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=generator, device=where).to(device)


@torch.no_grad()
def sequential_draft(
    markov_head: MarkovHead | None,
    confidence_head: ConfidenceHead | None,
    confidence_temperatures: torch.Tensor | None,
    base_logits: BaseLogits,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_probs: bool | None = None,
    min_survival: float = 0.0,
    draft_to_target: torch.Tensor | None = None,
    target_vocab: int | None = None,
) -> DraftOutput:
    """The left-to-right loop after the backbone pass; the one implementation of the
    sequential stage: the PyTorch drafter, evaluation and the vLLM proposer run it, and it
    is the reference the fused kernel (kernels/sequential_head.py) is tested against.

    base_logits: [N, K, V] backbone logits U_k or a function computing them for the rows
    still drafting; hidden: [N, K, d]; anchors: [N]; temperature: [N], a value <= 0 (or
    None for all) means greedy; confidence_temperatures: [K] (None: uncalibrated). Sampled
    rows take Gumbel-max noise keyed by (seed, position, token) from `kernels/rng.py`, the
    numbers the kernel draws, so both pick the same tokens for the same `seeds` [N] int64;
    without seeds they come from `generator`. Draft rows are returned when `return_probs`,
    by default exactly when some row samples. Computes in float32 (float64 for float64
    logits); outputs are float32.

    Early stop (`min_survival` > 0): at position k the confidence c_k is computed first (it
    reads h_k and the token x_{k-1} only); a request whose prefix survival a_k falls below
    `min_survival` stops drafting there and its logits at k and later are never computed.
    The stop reads only earlier tokens, so it is non-anticipating like the policies'.

    Reduced draft vocabulary: `base_logits` and the Markov bias cover the draft vocabulary
    and `draft_to_target` [N_draft] holds each draft id's target id; tokens come out as
    target ids (the Markov head reads them as such) and draft rows over `target_vocab`,
    zero outside the subset, so rejection sampling sees the exact draft distribution.
    """
    n, k, _ = hidden.shape
    device = hidden.device
    logits_at = base_logits if callable(base_logits) else (lambda rows, j: base_logits[rows, j])
    compute = torch.promote_types(hidden.dtype if callable(base_logits) else base_logits.dtype, torch.float32)
    sampled = torch.zeros(n, dtype=torch.bool, device=device) if temperature is None else temperature > 0
    any_sampled = bool(sampled.any())
    want_probs = any_sampled if return_probs is None else return_probs
    keys = row_temps = vocab_ids = None
    if any_sampled:
        assert temperature is not None
        keys = seed_key(draft_seeds(n, device, generator) if seeds is None else seeds.to(device))
        row_temps = torch.where(sampled, temperature, 1.0).to(compute)
    early_stop = min_survival > 0.0
    state = markov_head.initial_state(n, hidden) if markov_head is not None else None
    rows = torch.arange(n, device=device)  # requests still drafting
    prev = anchors.long()
    survival = torch.ones(n, dtype=compute, device=device)
    tokens = torch.zeros(n, k, dtype=torch.int64, device=device)
    token_probs = torch.ones(n, k, dtype=torch.float32, device=device)
    confidences = torch.zeros(n, k, dtype=torch.float32, device=device)
    depths = torch.zeros(n, dtype=torch.int64, device=device)
    probs: torch.Tensor | None = None
    lm_head_rows = 0
    for j in range(k):
        h = hidden[rows, j]
        feature = markov_head.markov_w1(prev) if markov_head is not None else None
        if confidence_head is not None:
            conf_logit = confidence_head.logit(h, feature).to(compute)
            t_conf = 1.0 if confidence_temperatures is None else confidence_temperatures[j].to(compute)
            conf = torch.sigmoid(conf_logit / t_conf)
        else:
            conf = torch.ones(len(rows), dtype=compute, device=device)
        if early_stop:
            alive = survival[rows] * conf >= min_survival
            if not bool(alive.all()):
                rows, prev, conf, h = rows[alive], prev[alive], conf[alive], h[alive]
                feature = None if feature is None else feature[alive]
                state = None if state is None else state[alive]
            if len(rows) == 0:
                break
            survival[rows] *= conf
        confidences[rows, j] = conf.float()
        logits = logits_at(rows, j).to(compute)
        lm_head_rows += len(rows)
        if markov_head is not None:
            bias, _, state = markov_head.step(prev, h, state)
            logits = logits + bias.to(compute)
        choice = logits.argmax(-1)
        if any_sampled:
            assert keys is not None and row_temps is not None
            row_sampled = sampled[rows]
            scaled = logits / row_temps[rows, None]
            if vocab_ids is None:
                vocab_ids = torch.arange(logits.shape[-1], device=device)
            noise = gumbel(step_key(keys[rows], j), vocab_ids).to(compute)
            choice = torch.where(row_sampled, (scaled + noise).argmax(-1), choice)
            log_p = torch.log_softmax(scaled, dim=-1)
            token_probs[rows, j] = torch.where(row_sampled, log_p.gather(1, choice[:, None])[:, 0].exp(), 1.0).float()
        if want_probs:
            if probs is None:  # point masses at token 0 where nothing is drafted
                vocab = target_vocab or logits.shape[-1]
                probs = torch.zeros(n, k, vocab, dtype=torch.float32, device=device)
                probs[:, :, 0] = 1.0
            row = torch.nn.functional.one_hot(choice, logits.shape[-1]).to(compute)
            if any_sampled:
                row = torch.where(row_sampled[:, None], log_p.exp(), row)
            if draft_to_target is None:
                probs[rows, j] = row.float()
            else:
                scattered = torch.zeros(len(rows), probs.shape[-1], dtype=torch.float32, device=device)
                scattered[:, draft_to_target] = row.float()
                probs[rows, j] = scattered
        if draft_to_target is not None:
            choice = draft_to_target[choice]
        tokens[rows, j] = choice
        depths[rows] += 1
        prev = choice
    return DraftOutput(
        tokens=tokens,
        token_probs=token_probs,
        confidences=confidences,
        probs=probs,
        depths=depths,
        lm_head_rows=lm_head_rows,
    )


def vanilla_heads(
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden_size: int,
    conf_weight: torch.Tensor | None = None,
    conf_bias: float = 0.0,
) -> tuple[MarkovHead, ConfidenceHead | None]:
    """The vanilla Markov head (and a confidence head) around raw weights, the fused
    kernel's interface: W1 [V, r], W2 [V, r] (or [V_draft, r] for a reduced draft
    vocabulary), confidence weight [d] or [d + r] (with the Markov
    feature). The kernel's reference is then `sequential_draft` itself. 16-bit weights are
    widened to float32, the precision the kernel accumulates in."""
    vocab, rank = w1.shape
    with_markov = conf_weight is not None and conf_weight.numel() == hidden_size + rank
    # Only the sizes the heads read; the rest of a drafter config does not apply here.
    config = DrafterConfig.model_construct(
        vocab_size=vocab, markov_rank=rank, hidden_size=hidden_size, confidence_head_with_markov=with_markov
    )
    with torch.device("meta"):  # no throwaway initialisation: the weights are set below
        markov = MarkovHead(config)
        confidence = ConfidenceHead(config) if conf_weight is not None else None
    markov.markov_w1.weight = _frozen(w1)
    markov.markov_w2.weight = _frozen(w2)
    if confidence is not None:
        assert conf_weight is not None
        confidence.proj.weight = _frozen(conf_weight.reshape(1, -1))
        confidence.proj.bias = _frozen(conf_weight.new_tensor([conf_bias]))
    return markov, confidence


def _frozen(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight.to(torch.promote_types(weight.dtype, torch.float32)), requires_grad=False)
