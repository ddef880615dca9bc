"""The drafter as a vLLM model: vLLM's DFlash backbone plus our sequential heads.

The backbone (fc, hidden_norm, KV-injected draft layers, norm) is vLLM's own
`DFlashQwen3ForCausalLM`, which computes what `vllm_dspark.model.layers` computes in plain
PyTorch. The Markov and confidence heads are the plain-PyTorch modules of this package,
so the proposer runs exactly the training-time code for the sequential stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from vllm_dspark.config import DrafterConfig
from vllm_dspark.model.drafter import target_ids_of
from vllm_dspark.model.heads import ConfidenceHead, MarkovHead, build_markov_head

HEAD_PREFIXES = ("markov_head.", "confidence_head.")


def drafter_config_from_hf(hf_config: object) -> DrafterConfig:
    """Our validated config from the (EAGLE-wrapped) Hugging Face config vLLM loaded."""
    raw = hf_config.to_dict()  # type: ignore[attr-defined]
    raw["architectures"] = list(raw.get("architectures") or [])
    return DrafterConfig.parse_checked(raw, source="speculative draft model config")


class VllmDSparkDraftModel(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.dspark_config = drafter_config_from_hf(self.config)
        self.markov_head: MarkovHead | None = build_markov_head(self.dspark_config)
        self.confidence_head: ConfidenceHead | None = (
            ConfidenceHead(self.dspark_config) if self.dspark_config.enable_confidence_head else None
        )
        temps = self.dspark_config.confidence_temperatures or [1.0] * self.dspark_config.block_size
        self.register_buffer("confidence_temperatures", torch.tensor(temps, dtype=torch.float32), persistent=False)
        self.draft_ids: torch.Tensor | None = None  # target id per draft id (reduced vocabulary)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (vLLM's `compute_logits` would scatter them
        into a target-wide row of -inf; the sequential stage maps the chosen ids instead)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head_params = dict(self.named_parameters())
        loaded_heads: set[str] = set()

        def backbone_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(HEAD_PREFIXES):
                    if name not in head_params:
                        raise ValueError(f"drafter checkpoint has unexpected head weight {name}")
                    head_params[name].data.copy_(tensor.to(head_params[name].dtype))
                    loaded_heads.add(name)
                else:
                    yield name, tensor

        super().load_weights(backbone_weights())
        self.draft_ids = None
        if self.draft_id_to_target_id is not None:  # a reduced draft vocabulary (d2t loaded)
            self.draft_ids = target_ids_of(self.draft_id_to_target_id.data, self.dspark_config.vocab_size)
        if self.confidence_head is not None:
            self.confidence_head.serving_bias = None  # re-read by the proposer after a reload
        expected = {n for n in head_params if n.startswith(HEAD_PREFIXES)}
        if expected - loaded_heads:
            raise ValueError(f"drafter checkpoint lacks head weights {sorted(expected - loaded_heads)}")
