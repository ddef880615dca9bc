"""Target hidden states the drafter reads, from a Hugging Face causal LM.

Captured with forward hooks so that layer i means "the residual stream after decoder
layer i" (and -1 the embedding output), exactly what vLLM captures while serving.
`output_hidden_states=True` would not do: its last entry is taken after the final norm.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@torch.no_grad()
def capture_target_states(
    model: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (context states [B, T, m * d] in `layer_ids` order, last hidden state
    [B, T, d] after the final norm, i.e. what the LM head reads)."""
    captured: dict[int, torch.Tensor] = {}
    layers = decoder_layers(model)
    inner = getattr(model, "model", model)

    def keep(index: int):
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [
        (inner.embed_tokens if i == -1 else layers[i]).register_forward_hook(keep(i)) for i in layer_ids
    ]
    try:
        out = inner(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    context = torch.cat([captured[i].float() for i in layer_ids], dim=-1)
    return context, out.last_hidden_state.float()
