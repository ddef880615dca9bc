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
    """One drafted block per request."""

    tokens: torch.Tensor  # [N, K] int64
    # Draft distribution rows at each request's temperature, [N, K, V]; None when all
    # requests are greedy (rejection sampling then needs no draft probabilities).
    probs: torch.Tensor | None
    confidences: torch.Tensor  # [N, K] calibrated conditional survival c_k


@torch.no_grad()
def sequential_draft(
    markov_head: MarkovHead | None,
    confidence_head: ConfidenceHead | None,
    confidence_temperatures: torch.Tensor,
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> DraftOutput:
    """The left-to-right loop after the backbone pass, shared by the PyTorch drafter and
    the vLLM proposer.

    base_logits: [N, K, V] backbone logits U_k; hidden: [N, K, d]; anchors: [N];
    temperature: [N], a value <= 0 (or None for all) means greedy.
    """
    n, k, _ = hidden.shape
    sampled = temperature is not None and bool((temperature > 0).any())
    state = markov_head.initial_state(n, hidden) if markov_head is not None else None
    prev = anchors.long()
    tokens, probs, confidences = [], [], []
    for j in range(k):
        logits = base_logits[:, j].float()
        feature = None
        if markov_head is not None:
            bias, feature, state = markov_head.step(prev, hidden[:, j], state)
            logits = logits + bias.float()
        if confidence_head is not None:
            conf_logit = confidence_head.logit(hidden[:, j], feature).float()
            confidences.append(torch.sigmoid(conf_logit / confidence_temperatures[j]))
        else:
            confidences.append(torch.ones(n, device=hidden.device))
        choice = logits.argmax(-1)
        if sampled:
            assert temperature is not None
            row_probs = torch.softmax(logits / temperature.clamp_min(1e-5).float().unsqueeze(-1), dim=-1)
            noise = torch.empty_like(row_probs).exponential_(generator=generator)
            choice = torch.where(temperature > 0, (row_probs / noise).argmax(-1), choice)
            probs.append(row_probs)
        tokens.append(choice)
        prev = choice
    return DraftOutput(
        tokens=torch.stack(tokens, 1),
        probs=torch.stack(probs, 1) if sampled else None,
        confidences=torch.stack(confidences, 1),
    )
