"""The drafter as a vLLM model: vLLM's DFlash backbone plus our sequential heads.

The backbone (fc, hidden_norm, KV-injected draft layers, norm) is vLLM's own
`DFlashQwen3ForCausalLM`, which computes what `vllm_dspark.model.layers` computes in plain
PyTorch. The Markov and confidence heads are the plain-PyTorch modules of this package,
so the proposer runs exactly the training-time code for the sequential stage.

One change to the backbone: its `fc`, which maps every context token's concatenated
target layers (five for SmolLM2: 2880 -> 576) and is the largest product of the context
pass, may run in bfloat16 while the rest stays in the weights' dtype
(`PluginOptions.context_projection`). A float32 target on a CPU with native bfloat16 pays
about half for it; only the drafts' rounding changes, never what verification accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from vllm_dspark.config import DrafterConfig, PluginOptions
from vllm_dspark.model.drafter import target_ids_of
from vllm_dspark.model.heads import ConfidenceHead, MarkovHead, build_markov_head

logger = logging.getLogger(__name__)

HEAD_PREFIXES = ("markov_head.", "confidence_head.")


def native_bfloat16_matmul() -> bool:
    """True where this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere
    oneDNN emulates it, slower than float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def context_projection_dtype(option: str, weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype `fc` computes in (`PluginOptions.context_projection`)."""
    if option == "auto":
        cheaper = weight_dtype == torch.float32 and device.type == "cpu" and native_bfloat16_matmul()
        return torch.bfloat16 if cheaper else weight_dtype
    return torch.bfloat16 if option == "bfloat16" else torch.float32


def product_in(weight: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T computed in `dtype`, the result in x's dtype. On a CPU through
    vLLM's oneDNN product, as vLLM runs its own linear layers there: torch's own
    bfloat16 product was slower than oneDNN's float32 one up to 8 rows (0.13-0.22 against
    0.06-0.15 ms), while oneDNN's bfloat16 one was at most as slow at every size
    (0.05 ms for one row, 2.4 against 5.0 ms for 300)."""
    low = weight.detach().to(dtype)
    if low.device.type == "cpu" and getattr(ops, "_supports_onednn", False):
        handler = ops.create_onednn_mm(low.t(), 32)
        return lambda x: ops.onednn_mm(handler, x.to(dtype), None).to(x.dtype)
    return lambda x: F.linear(x.to(dtype), low).to(x.dtype)


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
        self.context_projection = PluginOptions.from_additional_config(vllm_config.additional_config).context_projection
        # The dtype `fc` computes in, and its product where that is not its weights' own
        # (set on loading; None: vLLM's `fc` as loaded).
        self.fc_dtype: torch.dtype | None = None
        self._fc_product: Callable[[torch.Tensor], torch.Tensor] | None = None

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's `fc` over the target's concatenated layers, in `fc_dtype` (the result in
        the input's dtype)."""
        if self._fc_product is None or hidden_states.dim() != 2 or hidden_states.shape[-1] != self.model.fc.input_size:
            return super().combine_hidden_states(hidden_states)  # also its error for a wrong width
        return self._fc_product(hidden_states)

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
        self.fc_dtype, self._fc_product = None, None
        weight = getattr(self.model.fc, "weight", None) if self.model.use_aux_hidden_state else None
        if weight is not None and weight.is_floating_point():  # before vLLM's post-processing may pack it away
            self.fc_dtype = context_projection_dtype(self.context_projection, weight.dtype, weight.device)
            if self.fc_dtype != weight.dtype:
                self._fc_product = product_in(weight, self.fc_dtype)
            logger.info("vllm_dspark: the drafter's context projection computes in %s (context_projection=%s)",
                        str(self.fc_dtype).removeprefix("torch."), self.context_projection)
        self.draft_ids = None
        if self.draft_id_to_target_id is not None:  # a reduced draft vocabulary (d2t loaded)
            self.draft_ids = target_ids_of(self.draft_id_to_target_id.data, self.dspark_config.vocab_size)
        if self.confidence_head is not None:
            self.confidence_head.serving_bias = None  # re-read by the proposer after a reload
        expected = {n for n in head_params if n.startswith(HEAD_PREFIXES)}
        if expected - loaded_heads:
            raise ValueError(f"drafter checkpoint lacks head weights {sorted(expected - loaded_heads)}")
