"""The sequential stage of DSpark: Markov heads and the confidence head (DSPARK.md section 1).

Every head is a step function `(previous token, backbone hidden h_k, state) -> (bias over
the vocabulary, Markov feature W1[x_{k-1}], new state)`, so the drafting loop, training
with teacher forcing and the serving proposer all run the same code.
"""

from __future__ import annotations

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
        self.markov_w2 = nn.Linear(self.rank, config.vocab_size, bias=False)

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
    which is what rejection sampling must be given.
    """

    tokens: torch.Tensor  # [N, K] int64
    token_probs: torch.Tensor  # [N, K] float32, draft probability of each token (1 when greedy)
    confidences: torch.Tensor  # [N, K] float32 calibrated conditional survival c_k (1 without a head)
    probs: torch.Tensor | None  # [N, K, V] float32 draft rows, when requested


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
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    return_probs: bool | None = None,
) -> DraftOutput:
    """The left-to-right loop after the backbone pass; the one implementation of the
    sequential stage: the PyTorch drafter, evaluation and the vLLM proposer run it, and it
    is the reference the fused kernel (kernels/sequential_head.py) is tested against.

    base_logits: [N, K, V] backbone logits U_k; hidden: [N, K, d]; anchors: [N];
    temperature: [N], a value <= 0 (or None for all) means greedy; confidence_temperatures:
    [K] (None: uncalibrated). Sampled rows take Gumbel-max noise keyed by (seed, position,
    token) from `kernels/rng.py`, the numbers the kernel draws, so both pick the same tokens
    for the same `seeds` [N] int64; without seeds they come from `generator`. Draft rows
    are returned when `return_probs`, by default exactly when some row samples. Computes in
    float32 (float64 for float64 logits); outputs are float32.
    """
    n, k, vocab = base_logits.shape
    device = base_logits.device
    compute = torch.promote_types(base_logits.dtype, torch.float32)
    sampled = torch.zeros(n, dtype=torch.bool, device=device) if temperature is None else temperature > 0
    any_sampled = bool(sampled.any())
    want_probs = any_sampled if return_probs is None else return_probs
    if any_sampled:
        assert temperature is not None
        keys = seed_key(draft_seeds(n, device, generator) if seeds is None else seeds.to(device))
        vocab_ids = torch.arange(vocab, device=device)
        row_temps = torch.where(sampled, temperature, 1.0).to(compute)
    state = markov_head.initial_state(n, hidden) if markov_head is not None else None
    prev = anchors.long()
    ones = torch.ones(n, dtype=compute, device=device)
    tokens, token_probs, confidences, probs = [], [], [], []
    for j in range(k):
        logits = base_logits[:, j].to(compute)
        feature = None
        if markov_head is not None:
            bias, feature, state = markov_head.step(prev, hidden[:, j], state)
            logits = logits + bias.to(compute)
        if confidence_head is not None:
            conf_logit = confidence_head.logit(hidden[:, j], feature).to(compute)
            t_conf = 1.0 if confidence_temperatures is None else confidence_temperatures[j].to(compute)
            confidences.append(torch.sigmoid(conf_logit / t_conf))
        else:
            confidences.append(ones)
        choice = logits.argmax(-1)
        token_p = ones
        if any_sampled:
            scaled = logits / row_temps[:, None]
            noise = gumbel(step_key(keys, j), vocab_ids).to(compute)
            choice = torch.where(sampled, (scaled + noise).argmax(-1), choice)
            log_p = torch.log_softmax(scaled, dim=-1)
            token_p = torch.where(sampled, log_p.gather(1, choice[:, None])[:, 0].exp(), ones)
        if want_probs:
            point = torch.nn.functional.one_hot(choice, vocab).to(compute)
            probs.append(torch.where(sampled[:, None], log_p.exp(), point) if any_sampled else point)
        tokens.append(choice)
        token_probs.append(token_p)
        prev = choice
    return DraftOutput(
        tokens=torch.stack(tokens, 1),
        token_probs=torch.stack(token_probs, 1).float(),
        confidences=torch.stack(confidences, 1).float(),
        probs=torch.stack(probs, 1).float() if want_probs else None,
    )


def vanilla_heads(
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden_size: int,
    conf_weight: torch.Tensor | None = None,
    conf_bias: float = 0.0,
) -> tuple[MarkovHead, ConfidenceHead | None]:
    """The vanilla Markov head (and a confidence head) around raw weights, the fused
    kernel's interface: W1, W2 [V, r], confidence weight [d] or [d + r] (with the Markov
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
