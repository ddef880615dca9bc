"""Scheduler subclass: decides, before every step, how many drafts each request verifies.

Drafts arrive with their confidences (`update_draft_token_ids`). Before the parent
schedules, `spec_token_ids` of every decoding request is cut to the length the policy
chose, so dropped drafts never reach the token budget, the KV cache or the verifier.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.sampling_params import SamplingType
from vllm.v1.request import Request

from vllm_dspark.config import AUTO_PROFILE, PluginOptions
from vllm_dspark.engine_profile import cached_profile_path, profile_key
from vllm_dspark.integration.metrics import METRICS_FILE_KEY, DSparkStats
from vllm_dspark.kernels import dispatch
from vllm_dspark.scheduling import SpsCurve, dspark_budget, select_verify_lengths
from vllm_dspark.scheduling.overhead import StepOverheadEstimator, offset_for
from vllm_dspark.scheduling.recalibration import OnlineRecalibrator

logger = logging.getLogger(__name__)

_SNAPSHOT_INTERVAL_S = 1.0
# Per-request SLA floor a client can ask for: SamplingParams(extra_args={...}).
MIN_TOKENS_PER_S_ARG = "dspark_min_tokens_per_s"
# Live recalibration learns greedy and sampled requests apart: a greedy request accepts a
# draft only if it is the target's argmax, a sampled one with probability min(1, p/q).
RECALIBRATION_MODES = ("greedy", "sampled")


@dataclass(frozen=True)
class VerifyDecision:
    """What the policy decided in one step (kept for metrics, logs and tests)."""

    req_ids: tuple[str, ...]
    proposed: np.ndarray  # [R] drafts available per request
    verified: np.ndarray  # [R] drafts kept for verification
    confidences: np.ndarray  # [R, K] conditional confidences used (0 where absent)
    base_tokens: int


@dataclass(frozen=True)
class PendingVerification:
    """A scheduled step's drafts, kept until its output shows what the target accepted."""

    req_ids: tuple[str, ...]
    raw_confidences: np.ndarray  # [R, K] as the drafter sent them (after the NaN fallback)
    modes: np.ndarray  # [R] sampling mode of each request (RECALIBRATION_MODES)
    verified: np.ndarray  # [R]
    predicted: np.ndarray  # [R] expected accepted drafts (sum of calibrated survival)


class DSparkScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dspark_options = PluginOptions.from_additional_config(self.vllm_config.additional_config)
        self.sps_curve = self._load_sps_curve()
        # The curve the policies use: the profile plus the learned per-step offset.
        self.policy_curve = self.sps_curve
        self._applied_offset = 0.0  # the offset in policy_curve
        self.step_overhead = StepOverheadEstimator()
        # With pipeline parallelism the engine schedules the next batches before the first
        # finishes, so the time between schedule() calls is not a step: nothing to learn.
        self.learns_step_overhead = (
            self.dspark_options.measure_step_overhead and self.vllm_config.max_concurrent_batches == 1
        )
        self._previous_step: tuple[float, int] | None = None  # (start time, tokens in the pass)
        self.dspark_stats = DSparkStats(policy=str(self.dspark_options.policy))
        self.recent_decisions: deque[VerifyDecision] = deque(maxlen=4096)
        self._confidences: dict[str, np.ndarray] = {}
        self.recalibrators = (
            {mode: OnlineRecalibrator(learning_rate=self.dspark_options.recalibration_rate) for mode in RECALIBRATION_MODES}
            if self.dspark_options.recalibrate
            else {}
        )
        # One entry per scheduled step, oldest first (several are in flight under PP).
        self._pending: deque[PendingVerification | None] = deque(maxlen=16)
        self._async_budget: int | None = None
        self.admission_device = admission_device()
        # A stream of its own: reading the lengths back then waits for this small kernel,
        # not for model work queued on the default stream.
        on_gpu = self.admission_device is not None and self.admission_device.type == "cuda"
        self._admission_stream = torch.cuda.Stream(self.admission_device) if on_gpu else None
        self._metrics_file = (self.vllm_config.additional_config or {}).get(METRICS_FILE_KEY)
        self._last_log = self._last_snapshot = time.monotonic()
        logger.info(
            "vllm_dspark scheduler: policy=%s%s, survival-ranked admission on %s",
            self.dspark_options.policy,
            "" if self.sps_curve is None else f", SPS curve with {len(self.sps_curve.points)} points",
            "the GPU (Triton kernel)" if self.admission_device is not None else "the CPU (NumPy)",
        )

    def _load_sps_curve(self) -> SpsCurve | None:
        options = self.dspark_options
        if options.sps_profile != AUTO_PROFILE:
            return options.sps_curve()
        model = self.vllm_config.model_config
        key = profile_key(model.model, str(model.dtype).removeprefix("torch."))
        path = cached_profile_path(key)
        if path.is_file():
            logger.info("vllm_dspark: SPS profile for this engine from %s", path)
            return SpsCurve.load(path)
        logger.warning(
            "vllm_dspark: no cached SPS profile for %s (looked for %s); verifying with the "
            "'fixed' policy until one exists: run `vllm-dspark profile --model %s --out FILE --cache`",
            key,
            path,
            model.model,
        )
        options.policy = "fixed"
        return None

    # ----------------------------------------------------------- drafts in
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        super().update_draft_token_ids(draft_token_ids)
        confidences = getattr(draft_token_ids, "confidences", None)
        if confidences is None:
            return
        for req_id, row in zip(draft_token_ids.req_ids, confidences):
            request = self.requests.get(req_id)
            if request is not None and request.spec_token_ids:
                # validate_tokens may have shortened the drafts; keep aligned rows only.
                self._confidences[req_id] = np.asarray(row[: len(request.spec_token_ids)], dtype=np.float64)

    # --------------------------------------------------------- the decision
    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        started = time.perf_counter()
        self._learn_step_overhead(started)
        self._pending.append(self._trim_drafts())
        output = super().schedule(*args, **kwargs)
        tokens = output.total_num_scheduled_tokens
        self._previous_step = (started, tokens) if tokens else None
        return output

    def _learn_step_overhead(self, now: float) -> None:
        """Time since the previous step started = that step's wall time (the schedule ->
        execute -> update loop); compare it with the profile at that pass size."""
        if self._previous_step is None or self.sps_curve is None or not self.learns_step_overhead:
            return
        started, tokens = self._previous_step
        if not self.step_overhead.observe(now - started, self.sps_curve.step_time(tokens)):
            return
        offset = offset_for(self.sps_curve, self.step_overhead.seconds)
        self.dspark_stats.step_overhead_ms = 1000.0 * offset
        if abs(offset - self._applied_offset) > max(0.05 * abs(self._applied_offset), 1e-4):  # 5% / 0.1 ms
            self.policy_curve = self.sps_curve.with_step_overhead(offset)
            self._applied_offset = offset

    def _trim_drafts(self) -> PendingVerification | None:
        drafting = [r for r in self.running if r.spec_token_ids]
        if not drafting:
            return None
        proposed = np.array([len(r.spec_token_ids) for r in drafting], dtype=np.int64)
        raw_confidences = self._confidence_matrix(drafting, int(proposed.max()))
        modes = np.array([_recalibration_mode(r) for r in drafting])
        confidences = raw_confidences.copy()
        for mode, recalibrator in self.recalibrators.items():
            rows = modes == mode
            if rows.any():
                confidences[rows] = recalibrator.apply(raw_confidences[rows])
        options: dict[str, object] = {}
        policy = self.dspark_options.policy
        if policy == "fixed" and self.dspark_options.k is not None:
            options["k"] = self.dspark_options.k
        elif policy == "threshold":
            options["threshold"] = self.dspark_options.threshold
        elif policy == "sla":
            options["min_tokens_per_s"] = self._speed_floors(drafting)
        base_tokens = self._non_draft_tokens()
        if policy == "dspark_async":
            # The budget comes from the previous step's confidences (DSPARK.md section 4);
            # the first step has none and uses the early-stopping policy instead.
            if self._async_budget is None:
                policy = "dspark"
            else:
                options["budget"] = self._async_budget
            self._async_budget = dspark_budget(confidences, self.policy_curve, base_tokens=base_tokens)
        if policy == "dspark_async" and self.admission_device is not None:
            # The same top-budget selection as the NumPy policy (tests hold them equal).
            with torch.cuda.stream(self._admission_stream):  # no-op without one
                on_device = torch.as_tensor(confidences, device=self.admission_device)
                lengths = dispatch.admission_lengths(on_device, int(options["budget"])).cpu().numpy()
        else:
            lengths = select_verify_lengths(
                confidences, self.policy_curve or _no_curve, policy, base_tokens=base_tokens, **options
            )
        verified = np.minimum(lengths, proposed)
        for request, keep in zip(drafting, verified):
            if keep < len(request.spec_token_ids):
                request.spec_token_ids = request.spec_token_ids[: int(keep)]
        survival = np.cumprod(confidences, axis=1)
        predicted = np.where(np.arange(survival.shape[1]) < verified[:, None], survival, 0.0).sum(axis=1)
        req_ids = tuple(r.request_id for r in drafting)
        self.dspark_stats.record_decision(proposed, verified)
        self.recent_decisions.append(VerifyDecision(req_ids, proposed, verified, confidences, base_tokens))
        return PendingVerification(req_ids, raw_confidences, modes, verified, predicted)

    def _confidence_matrix(self, drafting: list[Request], width: int) -> np.ndarray:
        """[R, K] confidences; a request without them gets zeros (verify nothing), and
        NaN or out-of-range values are replaced by 0 (documented safe fallback)."""
        matrix = np.zeros((len(drafting), width))
        for row, request in enumerate(drafting):
            conf = self._confidences.pop(request.request_id, None)
            if conf is None:
                self.dspark_stats.missing_confidences += 1
                continue
            matrix[row, : len(conf)] = conf[:width]
        bad = ~np.isfinite(matrix) | (matrix < 0) | (matrix > 1)
        if bad.any():
            self.dspark_stats.invalid_confidences += int(bad.sum())
            logger.warning("vllm_dspark: %d invalid confidences (NaN/out of range) treated as 0", int(bad.sum()))
            matrix[bad] = 0.0
        return matrix

    def _non_draft_tokens(self) -> int:
        """Prefill tokens expected in the pass besides the decoding requests' own (the policy
        counts one per decoding request itself): chunks of running requests, plus prompts of
        waiting requests that fit the free request slots, taken in the parent's order (queue
        of requests holding KV blocks first) and leaving out those blocked on a grammar,
        remote KV or streaming input. An estimate (prefix-cache hits and a full KV cache
        admit less), capped by the step's token budget."""
        prefill = sum(
            r.num_tokens - r.num_computed_tokens for r in self.running if not r.spec_token_ids
        )
        free_slots = max(0, self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input)
        admissible = (
            r
            for queue in (self.kv_holding_waiting, self.waiting)
            for r in queue
            if not self._is_blocked_waiting_status(r.status)
        )
        prefill += sum(r.num_tokens - r.num_computed_tokens for r in islice(admissible, free_slots))
        return int(min(prefill, self.max_num_scheduled_tokens))

    def _speed_floors(self, drafting: list[Request]) -> np.ndarray:
        default = self.dspark_options.min_tokens_per_s
        floors = []
        for request in drafting:
            extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
            floors.append(float(extra.get(MIN_TOKENS_PER_S_ARG, default)))
        return np.array(floors)

    # ------------------------------------------------------ feedback out
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput):
        # Read the sampled tokens first: the parent trims them in place at stop conditions.
        self._record_acceptance(model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self.has_unfinished_requests():
            self._previous_step = None  # the engine idles until the next request: not a step
        self._publish()
        return outputs

    def _record_acceptance(self, model_runner_output: ModelRunnerOutput) -> None:
        """Observed accepted drafts against the confidences' prediction (live calibration
        error), and the outcome for the online recalibration."""
        pending = self._pending.popleft() if self._pending else None
        if pending is None:
            return
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        verified = pending.verified.copy()
        accepted = np.zeros_like(verified)
        for row, req_id in enumerate(pending.req_ids):
            out = index.get(req_id)
            if out is None or out >= len(sampled):
                verified[row] = 0  # no output for it this step: nothing was judged
                continue
            # The target emits the accepted drafts plus one token of its own.
            accepted[row] = min(verified[row], max(0, len(sampled[out]) - 1))
        self.dspark_stats.accepted += int(accepted.sum())
        self.dspark_stats.predicted_accepted += float(pending.predicted[verified > 0].sum())
        for mode, recalibrator in self.recalibrators.items():
            rows = pending.modes == mode
            if rows.any():
                recalibrator.observe(pending.raw_confidences[rows], verified[rows], accepted[rows])

    def _publish(self) -> None:
        """Snapshot for /metrics at most once a second, and whenever the engine goes idle
        (so a scrape after the last request sees final numbers); a summary log line."""
        now = time.monotonic()
        due = now - self._last_snapshot >= _SNAPSHOT_INTERVAL_S or not self.running
        if due or now - self._last_log >= self.dspark_options.log_interval_s:
            # Copied here, not every step: only the snapshot and the log line read them.
            for mode, recalibrator in self.recalibrators.items():
                if recalibrator.judged.any():
                    self.dspark_stats.confidence_slopes[mode] = recalibrator.slopes.round(4).tolist()
                    self.dspark_stats.confidence_shifts[mode] = recalibrator.shifts.round(4).tolist()
        if self._metrics_file is not None and due:
            self._last_snapshot = now
            self.dspark_stats.write(self._metrics_file)
        if now - self._last_log >= self.dspark_options.log_interval_s:
            self._last_log = now
            logger.info("vllm_dspark: %s", self.dspark_stats.summary())

    # --------------------------------------------------------- bookkeeping
    def _free_request(self, request: Request, *args, **kwargs):
        self._confidences.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


def _recalibration_mode(request: Request) -> str:
    params = request.sampling_params
    return "greedy" if params is None or params.sampling_type == SamplingType.GREEDY else "sampled"


def admission_device() -> torch.device | None:
    """The GPU when the Triton kernels are enabled and this process already holds a CUDA
    context (the worker shares the engine-core process); None selects the NumPy policy.
    A scheduler-only process (multiprocess executor) never creates a context of its own."""
    if dispatch.triton_kernels_enabled() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _no_curve(batch_tokens: np.ndarray) -> np.ndarray:
    """Stand-in SPS for policies that ignore the curve (fixed, threshold)."""
    return np.ones_like(np.asarray(batch_tokens, dtype=np.float64))
