"""Target hidden states the drafter reads, from a Hugging Face causal LM.

Captured with forward hooks so that layer i means "the residual stream after decoder
layer i" (and -1 the embedding output), exactly what vLLM captures while serving.
`output_hidden_states=True` would not do: its last entry is taken after the final norm.
`LayerCapture` is the one place those hooks are set, for whole sequences (training
features) and for incremental decoding with a KV cache (offline evaluation) alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class LayerCapture:
    """Forward hooks on the layers in `layer_ids` that keep their outputs of the latest
    forward pass; `states()` hands them over as the drafter's context."""

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        self.layer_ids = list(layer_ids)
        inner = getattr(model, "model", model)
        layers = decoder_layers(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [
            (inner.embed_tokens if i == -1 else layers[i]).register_forward_hook(self._keeper(i))
            for i in self.layer_ids
        ]

    def _keeper(self, index: int) -> Callable[[nn.Module, object, object], None]:
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            self._captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def states(self) -> torch.Tensor:
        """[B, T, m * d] fp32 states of the latest forward pass in `layer_ids` order; they
        are dropped here so that a stale pass can never be read twice."""
        states = torch.cat([self._captured[i].float() for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return states

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@torch.no_grad()
def capture_target_states(
    model: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (context states [B, T, m * d] in `layer_ids` order, last hidden state
    [B, T, d] after the final norm, i.e. what the LM head reads)."""
    with LayerCapture(model, layer_ids) as capture:
        out = getattr(model, "model", model)(input_ids=input_ids)
        context = capture.states()
    return context, out.last_hidden_state.float()
