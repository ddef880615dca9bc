"""The vllm_dspark proposer: vLLM's DFlash proposer with the DSpark sequential stage.

vLLM's V1 runner builds one proposer class for parallel drafters (`DFlashProposer`); the
patch module points that name at this subclass, which behaves exactly like its parent for
method "dflash" and adds, for "vllm_dspark":
- anchor-first sampling slots (slot k predicts the token at anchor position k + 1),
- the Markov loop with per-request temperature and exact draft probabilities,
- per-position confidences kept for the scheduler (`take_confidences`): one [N, K] array,
  copied to the host without blocking and read once the runner hands the drafts over.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_dspark import METHOD
from vllm_dspark.config import PluginOptions
from vllm_dspark.integration.compat import dflash_proposer_base
from vllm_dspark.integration.deferred_context import ContextRows, DeferredContext
from vllm_dspark.integration.outputs import DraftReport
from vllm_dspark.kernels import dispatch
from vllm_dspark.model.heads import DraftOutput, MarkovHead, draft_seeds, sequential_draft

# vLLM marks greedy requests with a temperature below this value.
_GREEDY_EPS = 1e-5


class DSparkProposer(dflash_proposer_base()):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        assert vllm_config.speculative_config is not None
        self.is_dspark = vllm_config.speculative_config.method == METHOD
        super().__init__(vllm_config, device, runner)
        self._anchors: torch.Tensor | None = None
        # Set by the runner before each proposal from the scheduler's plan: a request stops
        # drafting once its prefix survival falls below it (0 = draft every position).
        self.min_survival = 0.0
        # Set by the runner before a proposal predicted faster with the requests' n-gram
        # continuations alone (hybrid.DrafterSkip): only the context is stored, once.
        self.skip_for_ngram = False
        # Set by the runner before each proposal: [tokens of the step] true where the
        # token's request has the drafter (None: all have it). A proposal of no drafts
        # stores only those rows; a drafting one writes every row, as vLLM does.
        self.context_kept: torch.Tensor | None = None
        # The last proposal's confidences on the host (filled without blocking) and the
        # event after which they are there (None on CPU, where the copy is synchronous).
        self._confidences: torch.Tensor | None = None
        self._confidences_ready: torch.cuda.Event | None = None
        self._report: DraftReport | None = None
        self._timer = DraftTimer(device)
        options = PluginOptions.from_additional_config(vllm_config.additional_config)
        # Context K/V of steps that draft nothing, written before the next draft (None:
        # written every step).
        self._deferred = DeferredContext() if options.defer_context else None

    def propose(self, num_speculative_tokens: int, *args, **kwargs) -> torch.Tensor:
        """vLLM's proposal, timed; with 0 tokens asked for (the scheduler decided not to
        draft) or the n-gram skip set, only the context is stored (queued where deferred),
        without the drafter's forward pass."""
        if not self.is_dspark:
            return super().propose(num_speculative_tokens, *args, **kwargs)
        skipped, self.skip_for_ngram = self.skip_for_ngram and num_speculative_tokens > 0, False
        if skipped:
            num_speculative_tokens = 0
        if num_speculative_tokens == 0:
            return self.propose_context_only(lambda: self.step_context(*args, **kwargs),
                                             kwargs["common_attn_metadata"].batch_size(), skipped)
        self._timer.start()
        self._report = DraftReport(depth=num_speculative_tokens)
        self._write_deferred_context()
        drafts = super().propose(num_speculative_tokens, *args, **kwargs)
        self._timer.stop()
        return drafts

    @property
    def defers_context(self) -> bool:
        return self._deferred is not None

    def propose_context_only(
        self, context: Callable[[], ContextRows], batch_size: int, skipped_for_ngram: bool = False
    ) -> torch.Tensor:
        """A proposal of no drafts: the step's `context` rows are stored (queued where
        deferred), timed and reported as a proposal of depth 0."""
        self._timer.start()
        self._report = DraftReport(depth=0, skipped_for_ngram=skipped_for_ngram)
        rows, kept = context(), self.context_kept
        if kept is not None and len(kept) == len(rows):
            rows = rows.select(kept)
        if len(rows):
            self._store_context(rows)
        self._timer.stop()
        return torch.empty(batch_size, 0, dtype=torch.int64, device=self.device)

    def _store_context(self, rows: ContextRows) -> None:
        if self._deferred is None:
            self.write_context(rows)
            return
        self._deferred.add(rows)
        if self._deferred.full:
            self._write_deferred_context()

    def _write_deferred_context(self) -> None:
        rows = None if self._deferred is None else self._deferred.take()
        if rows is not None:
            self.write_context(rows)

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        num_tokens, sample_indices, new_cad = super().set_inputs_first_pass(
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        )
        if not self.is_dspark:
            return num_tokens, sample_indices, new_cad
        self._anchors = next_token_ids[: cad.batch_size()]
        # The parent samples the K mask slots (1..K); DSpark reads slots 0..K-1.
        return num_tokens, sample_indices - 1, new_cad

    def sample_block(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.is_dspark:
            return super().sample_block(hidden_states, sampling_metadata)
        assert self._anchors is not None
        k = self.num_speculative_tokens
        batch = hidden_states.shape[0] // k
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        temperature = None
        if not sampling_metadata.all_greedy and sampling_metadata.temperature is not None:
            temps = sampling_metadata.temperature[:batch].float()
            temperature = torch.where(temps < _GREEDY_EPS, torch.zeros_like(temps), temps)
        hidden = hidden_states.view(batch, k, -1)
        anchors = self._anchors[:batch]
        if fused_head_applies(model):
            base_logits = model.draft_logits(hidden_states).view(batch, k, -1)
            out = fused_sequential_draft(model, base_logits, hidden, anchors, temperature)
        else:
            # The LM head position by position, for the requests still drafting only.
            out = sequential_draft(
                model.markov_head, model.confidence_head, model.confidence_temperatures,
                lambda rows, j: model.draft_logits(hidden[rows, j]), hidden, anchors, temperature,
                min_survival=self.min_survival, draft_to_target=model.draft_ids,
                target_vocab=model.dspark_config.vocab_size,
            )
        assert self._report is not None
        self._report.lm_head_rows = batch * k if out.lm_head_rows is None else out.lm_head_rows
        self._keep_confidences(out.confidences)
        probs = None if out.probs is None else out.probs.reshape(batch * k, -1)
        return out.tokens.reshape(-1), probs

    def _keep_confidences(self, confidences: torch.Tensor) -> None:
        """Start the copy to the host; no sync here (propose runs ahead of the GPU)."""
        if confidences.device.type != "cuda":
            self._confidences, self._confidences_ready = confidences.float(), None
            return
        host = torch.empty(confidences.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(confidences, non_blocking=True)
        self._confidences_ready = torch.cuda.Event()
        self._confidences_ready.record()
        self._confidences = host

    def take_confidences(self) -> np.ndarray | None:
        """Confidences [N, K] of the last proposal, handed over once (then None until the
        next); waits for their copy only now, when the runner hands the drafts over."""
        confidences, self._confidences = self._confidences, None
        if confidences is None:
            return None
        if self._confidences_ready is not None:
            self._confidences_ready.synchronize()
        return confidences.numpy()

    def take_report(self) -> DraftReport | None:
        """What the last proposal cost (handed over once): depth asked for, LM-head rows
        computed, seconds (on CUDA read from events once the drafts are on the host)."""
        report, self._report = self._report, None
        if report is not None:
            report.seconds = self._timer.seconds()
        return report


class DraftTimer:
    """Wall time of a proposal: perf_counter on CPU; CUDA events on a GPU, read only when
    the drafts are handed over (the host must not wait for the GPU inside propose)."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = torch.device(device).type == "cuda"
        self._begin = self._end = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        if self.on_cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._end - self._begin


def fused_head_applies(model) -> bool:
    """The fused Triton head covers the vanilla Markov head with a confidence head, full
    or reduced draft vocabulary, on CUDA; everything else (and
    `VLLM_DSPARK_FORCE_REFERENCE=1`) runs the PyTorch loop. On an H200 with the committed
    SmolLM2 drafter's shapes a greedy drafting step took 0.47-0.94 ms through it at 1-64
    requests with the reduced vocabulary (0.44-0.49 with the full one), 2.9-5.4 ms
    through the loop (benchmarks/results/bench_kernels.md). It computes every position of
    every request: early stop (`min_survival`) is the loop's, which saves LM-head rows
    where they cost (on a CPU)."""
    return (
        dispatch.triton_kernels_enabled()
        and type(model.markov_head) is MarkovHead
        and model.confidence_head is not None
    )


def fused_sequential_draft(
    model, base_logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor, temperature: torch.Tensor | None
) -> DraftOutput:
    """The sequential stage in one fused kernel (kernels/sequential_head.py): for the same
    seeds, the tokens `sequential_draft` draws on the model's heads."""
    batch = base_logits.shape[0]
    temps = torch.zeros(batch, device=base_logits.device) if temperature is None else temperature
    # The sampler is keyed by (seed, step, token); fresh seeds every round.
    seeds = draft_seeds(batch, base_logits.device)
    proj = model.confidence_head.proj
    return dispatch.sequential_head(
        base_logits,
        anchors,
        model.markov_head.markov_w1.weight,
        model.markov_head.markov_w2.weight,
        temps,
        seeds,
        hidden=hidden,
        conf_weight=proj.weight.view(-1),
        conf_bias=confidence_bias(model.confidence_head),
        conf_temps=model.confidence_temperatures[: base_logits.shape[1]],  # K of this proposal
        return_probs=temperature is not None,
        draft_to_target=model.draft_ids,  # rows widened to W1's (the target's) vocabulary
    )


def confidence_bias(head: torch.nn.Module) -> float:
    """The confidence head's bias as a Python float, read once per model: reading a CUDA
    tensor every step would make the host wait for the GPU (weights are frozen in serving)."""
    value = getattr(head, "serving_bias", None)
    if value is None:
        value = head.serving_bias = float(head.proj.bias.detach())
    return value
