"""Plugin metrics: what the verification policy did, for Prometheus and the logs.

The scheduler runs in the engine-core process, while `/metrics` is served by the API
server process, and vLLM's stats messages between them have a fixed schema. So the
scheduler writes a small JSON snapshot (atomically, about once a second) to a file
named in the engine config, and a stat-logger plugin in the API server exposes it as
Prometheus metrics through a custom collector on vLLM's registry.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from vllm.v1.metrics.loggers import StatLoggerBase

METRICS_FILE_KEY = "vllm_dspark_metrics_file"


def new_metrics_file() -> str:
    """A per-engine snapshot path, chosen once in the front-end process."""
    directory = Path(os.environ.get("VLLM_DSPARK_METRICS_DIR", tempfile.gettempdir()))
    return str(directory / f"vllm_dspark_metrics_{os.getpid()}_{uuid.uuid4().hex[:8]}.json")


@dataclass
class DSparkStats:
    """Cumulative counters since engine start."""

    policy: str = ""
    steps: int = 0
    proposed: int = 0  # draft tokens the drafter proposed
    verified: int = 0  # draft tokens the policy sent to verification
    accepted: int = 0  # verified draft tokens the target accepted
    predicted_accepted: float = 0.0  # sum of prefix survival a_k over verified tokens
    verified_requests: int = 0  # (request, step) pairs that verified >= 0 drafts
    missing_confidences: int = 0
    invalid_confidences: int = 0
    step_overhead_ms: float = 0.0  # learned per-step time beyond the SPS profile (drafting)
    # Live recalibration per sampling mode ("greedy", "sampled") and block position:
    # c' = sigmoid(slope * logit(c) + shift).
    confidence_slopes: dict[str, list[float]] = field(default_factory=dict)
    confidence_shifts: dict[str, list[float]] = field(default_factory=dict)
    # verified_length_counts[l] = number of (request, step) pairs that verified l drafts
    verified_length_counts: list[int] = field(default_factory=list)

    @property
    def pruned(self) -> int:
        return self.proposed - self.verified

    @property
    def calibration_error(self) -> float:
        """Mean over verified drafts of predicted survival minus observed acceptance
        (0 = calibrated, > 0 = over-confident)."""
        return (self.predicted_accepted - self.accepted) / max(1, self.verified)

    def record_decision(self, proposed: np.ndarray, verified: np.ndarray) -> None:
        self.steps += 1
        self.proposed += int(proposed.sum())
        self.verified += int(verified.sum())
        self.verified_requests += len(verified)
        width = int(proposed.max(initial=0)) + 1
        if len(self.verified_length_counts) < width:
            self.verified_length_counts += [0] * (width - len(self.verified_length_counts))
        for length in verified:
            self.verified_length_counts[int(length)] += 1

    def summary(self) -> str:
        return (
            f"policy {self.policy}: {self.steps} steps, drafts proposed {self.proposed}, "
            f"verified {self.verified}, pruned {self.pruned} "
            f"({100.0 * self.pruned / max(1, self.proposed):.1f}%), accepted {self.accepted} "
            f"(predicted {self.predicted_accepted:.1f}, calibration error "
            f"{self.calibration_error:+.3f} per verified draft), mean verification budget "
            f"{self.verified / max(1, self.verified_requests):.2f} tokens/request, step overhead "
            f"beyond the SPS profile {self.step_overhead_ms:.1f} ms"
            + "".join(
                f", {mode} confidence recalibration: slopes {[round(x, 2) for x in self.confidence_slopes[mode]]} "
                f"shifts {[round(x, 2) for x in shifts]}"
                for mode, shifts in self.confidence_shifts.items()
            )
        )

    def write(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(asdict(self), handle)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str) -> "DSparkStats | None":
        try:
            with open(path) as handle:
                return cls(**json.load(handle))
        except (OSError, ValueError, TypeError):
            return None


def metric_families(stats: DSparkStats) -> list:
    """Prometheus metric families for one snapshot."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["policy"]
    values = [stats.policy]
    families = []
    for name, doc, value in [
        ("proposed_draft_tokens", "Draft tokens proposed by the drafter", stats.proposed),
        ("verified_draft_tokens", "Draft tokens the policy sent to verification", stats.verified),
        ("pruned_draft_tokens", "Draft tokens the policy dropped before verification", stats.pruned),
        ("accepted_draft_tokens", "Verified draft tokens the target accepted", stats.accepted),
        ("predicted_accepted_draft_tokens", "Accepted drafts predicted by confidences", stats.predicted_accepted),
        ("invalid_confidences", "NaN or out-of-range confidences replaced by 0", stats.invalid_confidences),
    ]:
        family = CounterMetricFamily(f"vllm_dspark_{name}", doc, labels=labels)
        family.add_metric(values, value)
        families.append(family)
    gauge = GaugeMetricFamily(
        "vllm_dspark_calibration_error",
        "Mean predicted survival minus observed acceptance over verified drafts since start",
        labels=labels,
    )
    gauge.add_metric(values, stats.calibration_error)
    families.append(gauge)
    overhead = GaugeMetricFamily(
        "vllm_dspark_step_overhead_seconds",
        "Learned per-step time beyond the SPS profile (drafting), added to SPS by the policies",
        labels=labels,
    )
    overhead.add_metric(values, stats.step_overhead_ms / 1000.0)
    families.append(overhead)
    for name, doc, by_mode in [
        ("confidence_logit_slope", "Live recalibration: slope on the confidence logit, per sampling mode and block position", stats.confidence_slopes),
        ("confidence_logit_shift", "Live recalibration: shift added to the confidence logit, per sampling mode and block position", stats.confidence_shifts),
    ]:
        family = GaugeMetricFamily(f"vllm_dspark_{name}", doc, labels=[*labels, "mode", "position"])
        for mode, series in by_mode.items():
            for position, value in enumerate(series, start=1):
                family.add_metric([*values, mode, str(position)], value)
        families.append(family)
    cumulative = np.cumsum(stats.verified_length_counts).tolist() if stats.verified_length_counts else []
    buckets = [(str(length), count) for length, count in enumerate(cumulative)] + [("+Inf", stats.verified_requests)]
    histogram = HistogramMetricFamily(
        "vllm_dspark_verification_budget",
        "Draft tokens verified per request per step",
        labels=labels,
    )
    histogram.add_metric(values, buckets, sum_value=stats.verified)
    families.append(histogram)
    return families


class _SnapshotCollector:
    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self):
        stats = DSparkStats.read(self.path)
        return metric_families(stats) if stats is not None else []


class DSparkMetricsLogger(StatLoggerBase):
    """vLLM stat-logger plugin (entry point `vllm.stat_logger_plugins`) that publishes
    the scheduler's snapshot on the API server's `/metrics`."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.path = (vllm_config.additional_config or {}).get(METRICS_FILE_KEY)
        if self.path is None:
            return
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        get_prometheus_registry().register(_SnapshotCollector(self.path))

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        """Nothing to do per step: the collector reads the snapshot on each scrape."""

    def log_engine_initialized(self) -> None:
        """The scheduler logs its own start-up line."""
