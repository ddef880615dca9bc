"""Scheduler subclass: the adapter between vLLM's V1 scheduler and the verification controller.

Drafts arrive with their confidences (`update_draft_token_ids`), with the hybrid option
also each request's n-gram continuation; the controller picks one proposal per request
and the n-gram picks are marked on the scheduler output (`POINT_MASS_FIELD`), so the
worker verifies them as point masses. Before the parent
schedules, the controller decides how many drafts each decoding request verifies and
`spec_token_ids` is cut to that length, so dropped drafts never reach the token budget,
the KV cache or the verifier. After the step, the tokens each request emitted go back to
the controller. Every decision lives in `scheduling/controller.py`; this class only
gathers its inputs from vLLM and applies its lengths.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request

from vllm_dspark.config import PluginOptions
from vllm_dspark.integration import compat
from vllm_dspark.integration.metrics import attach_stats
from vllm_dspark.integration.outputs import (
    DRAFTER_SKIP_FIELD,
    MIN_SURVIVAL_FIELD,
    POINT_MASS_FIELD,
    VERIFIES_NEXT_FIELD,
    WITHOUT_DRAFTER_FIELD,
)
from vllm_dspark.kernels import dispatch
from vllm_dspark.scheduling.controller import StepInputs, VerificationController
from vllm_dspark.scheduling.policies import Admission, admit_top_budget
from vllm_dspark.scheduling.profiles import resolve_sps_curve
from vllm_dspark.scheduling.sla import MIN_TOKENS_PER_S_ARG, request_floor

logger = logging.getLogger(__name__)

_SNAPSHOT_INTERVAL_S = 1.0


class DSparkScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options = PluginOptions.from_additional_config(self.vllm_config.additional_config)
        model = self.vllm_config.model_config
        curve = resolve_sps_curve(options, model.model, str(model.dtype).removeprefix("torch."))
        self.admission_device = admission_device()
        self.controller = VerificationController(
            options,
            curve,
            num_speculative_tokens=self.num_spec_tokens,
            # With pipeline parallelism the engine schedules the next batches before the
            # first finishes, so the time between schedule() calls is not a step.
            can_time_steps=self.vllm_config.max_concurrent_batches == 1,
            admission=self._admission(),
        )
        # The last drafts' confidences: one [N, K] array and the row of each request.
        self._confidences: tuple[dict[str, int], np.ndarray] | None = None
        # Requests whose pending proposal is an n-gram continuation -> its match length.
        self._ngram_matches: dict[str, int] = {}
        # Requests admitted without the drafter (controller.admit_drafter), until they finish.
        self._without_drafter: set[str] = set()
        self._last_log = self._last_snapshot = time.monotonic()
        logger.info(
            "vllm_dspark scheduler: policy=%s%s, survival-ranked admission on %s",
            self.controller.policy.name,
            "" if curve is None else f", SPS curve with {len(curve.points)} points",
            "the GPU (Triton kernel)" if self.admission_device is not None else "the CPU (NumPy)",
        )

    def _admission(self) -> Admission:
        """Top-budget admission on the GPU when this process holds one (the same
        selection as NumPy's; tests hold them equal), else NumPy."""
        device = self.admission_device
        if device is None:
            return admit_top_budget
        # A stream of its own: reading the lengths back then waits for this small kernel,
        # not for model work queued on the default stream.
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None

        def admit(confidences: np.ndarray, budget: int) -> np.ndarray:
            with torch.cuda.stream(stream):  # no-op without one
                on_device = torch.as_tensor(confidences, device=device)
                return dispatch.admission_lengths(on_device, int(budget)).cpu().numpy()

        return admit

    # ----------------------------------------------------------- drafts in
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        confidences = getattr(draft_token_ids, "confidences", None)
        report = getattr(draft_token_ids, "report", None)
        proposals = getattr(draft_token_ids, "ngram", None)
        if proposals is not None and self.controller.ngram is not None:
            draft_token_ids = self._choose_proposals(draft_token_ids, confidences, proposals)
        if self._without_drafter:  # their blocks were drafted without their context: never verified
            draft_token_ids = DraftTokenIds(draft_token_ids.req_ids, [
                [] if req_id in self._without_drafter and req_id not in self._ngram_matches else drafts
                for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)])
        super().update_draft_token_ids(draft_token_ids)
        if confidences is not None:
            rows = {req_id: row for row, req_id in enumerate(draft_token_ids.req_ids)}
            self._confidences = (rows, np.asarray(confidences))
        if report is not None:
            req_ids = draft_token_ids.req_ids
            self.controller.observe_drafting(len(req_ids), report.depth, report.lm_head_rows, report.seconds,
                                             report.skipped_for_ngram, self._count_with_drafter(req_ids))

    def _choose_proposals(self, drafts: DraftTokenIds, confidences: np.ndarray | None, proposals) -> DraftTokenIds:
        """Each request's drafter block or its n-gram continuation, as the controller
        prefers (from the drafter's first confidence and the match, nothing drawn)."""
        req_ids = drafts.req_ids
        confidences = None if confidences is None else np.asarray(confidences)
        depth = 0 if confidences is None else confidences.shape[1]
        first = confidences[:, 0] if depth else np.zeros(len(req_ids))
        greedy = np.array([_is_greedy(self.requests[r]) if r in self.requests else True for r in req_ids], dtype=bool)
        with_drafter = (np.array([r not in self._without_drafter for r in req_ids], dtype=bool)
                        if self._without_drafter else None)
        chosen = self.controller.prefer_ngram(first, greedy, proposals, depth, with_drafter)
        lists = list(drafts.draft_token_ids)
        for row, req_id in enumerate(req_ids):
            request = self.requests.get(req_id)
            if chosen[row] and request is not None and not request.is_finished():  # as the parent skips them
                lists[row] = proposals.tokens[row, : proposals.lengths[row]].tolist()
                self._ngram_matches[req_id] = int(proposals.matches[row])
            else:
                self._ngram_matches.pop(req_id, None)
        return DraftTokenIds(req_ids, lists)

    def add_request(self, request: Request) -> None:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if extra and MIN_TOKENS_PER_S_ARG in extra:
            try:
                request_floor(extra, 0.0, strict=True)
            except ValueError as error:
                logger.warning("vllm_dspark: request %s: %s; using the default floor", request.request_id, error)
        super().add_request(request)

    # --------------------------------------------------------- the decision
    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        started = time.perf_counter()
        self.controller.step_started(started)
        drafting = [r for r in self.running if r.spec_token_ids]
        if self._ngram_matches:  # entries of finished or preempted requests go
            self._ngram_matches = {r.request_id: self._ngram_matches[r.request_id] for r in drafting
                                   if r.request_id in self._ngram_matches}
        if drafting:
            decision = self.controller.decide(self._step_inputs(drafting))
            for request, keep in zip(drafting, decision.verified):
                if keep < len(request.spec_token_ids):
                    request.spec_token_ids = request.spec_token_ids[: int(keep)]
        self._confidences = None
        output = super().schedule(*args, **kwargs)
        num_requests = len(output.num_scheduled_tokens)
        # The load a new request joins: every request in the engine, not this pass (a
        # burst's first passes hold only the prompts that fit the token budget).
        load = min(len(self.running) + len(self.waiting), self.max_num_running_reqs)
        for new in output.scheduled_new_reqs:
            if not self.controller.admit_drafter(load):
                self._without_drafter.add(new.req_id)
        without_drafter = frozenset(r for r in self._without_drafter if r in output.num_scheduled_tokens)
        with_drafter = num_requests - len(without_drafter)
        scheduled = {req_id: len(ids) for req_id, ids in output.scheduled_spec_decode_tokens.items()}
        # Tokens beyond one per running request and its drafts are prompt tokens (prefill).
        prefill = output.total_num_scheduled_tokens - num_requests - sum(scheduled.values())
        self.controller.step_scheduled(started, output.total_num_scheduled_tokens, scheduled, max(0, prefill),
                                       num_requests, with_drafter)
        setattr(output, POINT_MASS_FIELD, frozenset(r for r in scheduled if r in self._ngram_matches))
        # The worker leaves these requests' tokens out of the drafter's context.
        setattr(output, WITHOUT_DRAFTER_FIELD, without_drafter)
        # How the worker drafts after this step (vLLM's dynamic speculation field).
        plan = self.controller.plan_drafting(num_requests, with_drafter)
        output.num_spec_tokens_to_schedule = plan.depth
        setattr(output, MIN_SURVIVAL_FIELD, plan.min_survival)
        setattr(output, DRAFTER_SKIP_FIELD, plan.drafter_skip)
        setattr(output, VERIFIES_NEXT_FIELD, plan.verifies)
        return output

    def _count_with_drafter(self, req_ids: list[str]) -> int:
        if not self._without_drafter:
            return len(req_ids)
        return sum(1 for r in req_ids if r not in self._without_drafter)

    def _step_inputs(self, drafting: list[Request]) -> StepInputs:
        proposed = np.array([len(r.spec_token_ids) for r in drafting], dtype=np.int64)
        width = int(proposed.max())
        confidences = np.zeros((len(drafting), width))
        found = np.zeros(len(drafting), dtype=bool)
        if self._confidences is not None:
            rows, matrix = self._confidences
            index = np.array([rows.get(r.request_id, -1) for r in drafting])
            found = index >= 0
            cols = min(width, matrix.shape[1])
            confidences[found, :cols] = matrix[index[found], :cols]
        # validate_tokens may have shortened the drafts: no confidence beyond a request's own.
        confidences[np.arange(width) >= proposed[:, None]] = 0.0
        floors = None
        if self.controller.policy.uses_request_floors:
            default = self.controller.options.min_tokens_per_s
            floors = np.array([request_floor(_extra_args(r), default) for r in drafting])
        base_tokens, plain_requests = self._other_tokens()
        matches = None
        if self._ngram_matches:
            matches = np.array([self._ngram_matches.get(r.request_id, 0) for r in drafting], dtype=np.int64)
        drafter_rows = np.ones(len(drafting), dtype=bool) if matches is None else matches == 0
        return StepInputs(
            req_ids=tuple(r.request_id for r in drafting),
            confidences=confidences,
            proposed=proposed,
            greedy=np.array([_is_greedy(r) for r in drafting], dtype=bool),
            base_tokens=base_tokens,
            plain_requests=plain_requests,
            min_tokens_per_s=floors,
            missing=int((drafter_rows & ~found).sum()),  # n-gram rows have no drafter confidences
            ngram_matches=matches,
        )

    def _other_tokens(self) -> tuple[int, int]:
        """Tokens expected in the pass besides the drafting requests' own (the policy
        counts one per drafting request itself), and how many of them are decoding
        requests without drafts (`other_tokens`). The waiting prompts that fit the free
        request slots are admitted in the parent's order: an estimate (prefix-cache hits
        and a full KV cache admit less). Capped by the step's token budget."""
        waiting = compat.admissible_waiting(self, compat.free_request_slots(self))
        tokens, plain = other_tokens([r for r in self.running if not r.spec_token_ids], waiting)
        tokens = int(min(tokens, self.max_num_scheduled_tokens))
        return tokens, min(plain, tokens)

    # ------------------------------------------------------ feedback out
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput):
        # Read the sampled tokens first: the parent trims them in place at stop conditions.
        self.controller.observe(self._emitted(model_runner_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._without_drafter:
            self._without_drafter.intersection_update(self.requests)  # finished ones go
        if not self.has_unfinished_requests():
            self.controller.engine_idle()
        now = time.monotonic()
        if not self.running:
            self.controller.refresh_gauges()  # final numbers for in-process readers
        if now - self._last_log >= self.controller.options.log_interval_s:
            self._last_log = now
            self.controller.refresh_gauges()
            logger.info("vllm_dspark: %s", self.controller.stats.summary())
        return outputs

    def _emitted(self, model_runner_output: ModelRunnerOutput) -> np.ndarray | None:
        req_ids = self.controller.awaiting_outcome()
        if not req_ids:
            return None
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        rows = [index.get(req_id, len(sampled)) for req_id in req_ids]
        return np.array([len(sampled[row]) if row < len(sampled) else -1 for row in rows])

    def make_stats(self, *args, **kwargs):
        """vLLM's scheduler stats plus the plugin's, at most once a second and whenever the
        engine goes idle (so a scrape after the last request sees final numbers)."""
        stats = super().make_stats(*args, **kwargs)
        now = time.monotonic()
        if stats is not None and (now - self._last_snapshot >= _SNAPSHOT_INTERVAL_S or not self.running):
            self._last_snapshot = now
            self.controller.refresh_gauges()
            attach_stats(stats, self.controller.stats)
        return stats


def _extra_args(request: Request) -> dict | None:
    return request.sampling_params.extra_args if request.sampling_params else None


def _is_greedy(request: Request) -> bool:
    params = request.sampling_params
    return params is None or params.sampling_type == SamplingType.GREEDY


def admission_device() -> torch.device | None:
    """The GPU when the Triton kernels are enabled and this process already holds a CUDA
    context (the worker shares the engine-core process); None selects the NumPy policy.
    A scheduler-only process (multiprocess executor) never creates a context of its own."""
    if dispatch.triton_kernels_enabled() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def other_tokens(running_without_drafts: list[Request], admitted: list[Request]) -> tuple[int, int]:
    """(tokens, plain requests) the pass carries for requests that verify nothing: a
    running request with at most one token to compute decodes it (one token it emits,
    like a drafting request's own; the policy's throughput counts it), one with more
    computes a prompt chunk, and an admitted waiting request its prompt."""
    left = [max(0, r.num_tokens - r.num_computed_tokens) for r in running_without_drafts]
    plain = sum(1 for tokens in left if tokens <= 1)
    prefill = sum(tokens for tokens in left if tokens > 1) + sum(r.num_tokens - r.num_computed_tokens for r in admitted)
    return prefill + plain, plain
