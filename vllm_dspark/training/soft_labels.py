"""The target's next-token distribution as training sees it: its k most likely tokens.

Rebuilding p_t from the target's last hidden state costs a 49K-wide LM head and softmax per
supervised position, every step; most of that mass sits on a few tokens. Feature
extraction therefore keeps only the top k probabilities of each position (and the mass
left outside them, `rest`), and the TV loss (losses.py) is computed from them with a
stated bound. `coverage` reports how much mass a given k keeps, to choose k from data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TOPK = 64


@dataclass(frozen=True)
class TopKProbs:
    """p_t on its k most likely tokens; the remaining mass is known only in total."""

    ids: torch.Tensor  # [..., k] int64 token ids (-1: outside the draft vocabulary, see `reindexed`)
    probs: torch.Tensor  # [..., k] float32 their probabilities (descending)

    @classmethod
    def of(cls, probs: torch.Tensor, k: int) -> TopKProbs:
        """The top k of a dense distribution [..., V] (k >= V keeps it whole)."""
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return cls(top.indices, top.values.float())

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int) -> TopKProbs:
        return cls.of(torch.softmax(logits.float(), dim=-1), k)

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    @property
    def rest(self) -> torch.Tensor:
        """[...] target mass outside the kept tokens."""
        return (1.0 - self.probs.sum(-1)).clamp_min(0.0)

    def __getitem__(self, index) -> TopKProbs:
        """Index the leading (position) dimensions, e.g. [rows, positions]."""
        return TopKProbs(self.ids[index], self.probs[index])

    def reindexed(self, index: torch.Tensor) -> TopKProbs:
        """The same probabilities under new token ids `index[id]` (e.g. a reduced draft
        vocabulary's `target_to_draft`; -1 marks a token the new vocabulary lacks)."""
        return TopKProbs(index[self.ids], self.probs)

    def to(self, device: torch.device) -> TopKProbs:
        return TopKProbs(self.ids.to(device), self.probs.to(device))


def coverage(logits: torch.Tensor, ks: list[int]) -> dict[int, float]:
    """Mean target mass kept by the top k, for each k, over positions [..., V]."""
    probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
    cumulative = probs.cumsum(-1)
    return {k: float(cumulative[..., min(k, probs.shape[-1]) - 1].mean()) for k in ks}
