"""The target model for offline evaluation: a Hugging Face causal LM with a KV cache that
also returns the hidden states the drafter reads.

Each speculative round then costs one target forward of K + 1 tokens instead of the whole
sequence. Hidden states are captured by `vllm_dspark.model.target_features.LayerCapture`,
the hooks training features come from (layer i = residual stream after decoder layer i,
-1 = embeddings), kept for every cached position and cropped with the cache after a
rejection, so the drafter always sees the states of the tokens that were kept.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from vllm_dspark.model.target_features import LayerCapture


class IncrementalTarget:
    """One sequence at a time; `reset` before each new prompt."""

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self._capture = LayerCapture(model, self.layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.context = torch.empty(1, 0, 0)

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, layer_ids: list[int]) -> "IncrementalTarget":
        """fp32 on purpose: on CPUs without bf16 hardware bf16 compute is several times slower."""
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
        return cls(model, layer_ids)

    @property
    def length(self) -> int:
        """Number of positions in the cache (and in `context`)."""
        return self.context.shape[1]

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.context = torch.empty(1, 0, 0)

    @torch.inference_mode()
    def extend(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Feed `input_ids` [1, n] after the cached positions; returns fp32 logits of the
        last `logits_to_keep` positions (0 = all) and appends their context states."""
        out = self.model(
            input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        states = self._capture.states()
        self.context = states if self.length == 0 else torch.cat([self.context, states], dim=1)
        return out.logits.float()

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop rejected draft tokens)."""
        removed = self.length - length
        if removed < 0:
            raise ValueError(f"cannot crop {self.length} cached positions to {length}")
        if removed:
            self.cache.crop(-removed)
            self.context = self.context[:, :length]

    def close(self) -> None:
        self._capture.close()
