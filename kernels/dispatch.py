"""Public entry points: the Triton kernel on CUDA, the PyTorch reference everywhere else.

The sequential head's reference is the model's own loop, `heads.sequential_draft`, on
the vanilla heads built around the same weights.

`VLLM_DSPARK_FORCE_REFERENCE=1` forces the reference (a switch for debugging and for
bisecting numerical differences). Every wrapper also takes `use_kernel` to override the
choice, which is how tests run the kernels on CPU tensors under the Triton interpreter.
"""

import importlib.util
import os
from typing import Optional

import torch

from vllm_dspark.model.heads import DraftOutput, sequential_draft, vanilla_heads

from .admission import admission_lengths_reference, admission_lengths_triton
from .sequential_head import check_inputs, sequential_head_triton
from .verify_attention import verify_attention_reference, verify_attention_triton

FORCE_REFERENCE_ENV = "VLLM_DSPARK_FORCE_REFERENCE"


def triton_kernels_enabled() -> bool:
    """True when CUDA is available, Triton is importable and the reference is not forced."""
    if os.environ.get(FORCE_REFERENCE_ENV, "0") == "1":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _pick(use_kernel: Optional[bool]) -> bool:
    return triton_kernels_enabled() if use_kernel is None else use_kernel


def verify_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    tree_parents: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    max_q: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    use_kernel: Optional[bool] = None,
) -> torch.Tensor:
    """Chain or tree verification attention; see `verify_attention.py` for the layouts.
    The result goes into `out` (shaped like q) when given."""
    args = (q, k_new, v_new, key_cache, value_cache, block_table, context_lens, cu_seqlens_q, tree_parents, scale)
    if _pick(use_kernel):
        return verify_attention_triton(*args, max_q=max_q, out=out)
    result = verify_attention_reference(*args)
    return result if out is None else out.copy_(result)


def sequential_head(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    hidden: Optional[torch.Tensor] = None,
    conf_weight: Optional[torch.Tensor] = None,
    conf_bias: float = 0.0,
    conf_temps: Optional[torch.Tensor] = None,
    return_probs: bool = False,
    use_kernel: Optional[bool] = None,
    draft_to_target: Optional[torch.Tensor] = None,
    target_vocab: Optional[int] = None,
) -> DraftOutput:
    """K steps of the Markov head with sampling and confidence; see `sequential_head.py`.
    hidden may be None without a confidence head. Reduced draft vocabulary: base logits
    and W2 over the draft ids, W1 over the target vocabulary, `draft_to_target` [V_draft]."""
    check_inputs(base_logits, anchor, w1, w2, hidden, conf_weight, conf_temps, temperature, seeds, draft_to_target)
    if _pick(use_kernel):
        return sequential_head_triton(
            base_logits, anchor, w1, w2, temperature, seeds, hidden, conf_weight, conf_bias, conf_temps, return_probs,
            draft_to_target=draft_to_target, target_vocab=target_vocab,
        )
    if hidden is None:  # the vanilla head does not read it
        hidden = base_logits.new_empty(*base_logits.shape[:2], 0)
    markov_head, confidence_head = vanilla_heads(w1, w2, hidden.shape[2], conf_weight, conf_bias)
    return sequential_draft(
        markov_head, confidence_head, conf_temps, base_logits, hidden, anchor, temperature, seeds,
        return_probs=return_probs, draft_to_target=draft_to_target,
        target_vocab=target_vocab or (None if draft_to_target is None else w1.shape[0]),
    )


def admission_lengths(conf: torch.Tensor, budget: int, use_kernel: Optional[bool] = None) -> torch.Tensor:
    """Per-request verify lengths [R] int64 from confidences [R, K] under a token budget."""
    if _pick(use_kernel):
        return admission_lengths_triton(conf, budget)
    return admission_lengths_reference(conf, budget)
