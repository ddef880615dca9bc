"""Plugin metrics: what the verification controller did, on the API server's `/metrics`.

The scheduler runs in the engine-core process, `/metrics` is served by the API server
process. The plugin's counters travel the way vLLM's own scheduler stats do: every
`SchedulerStats` message from the engine core carries a `vllm_dspark` field (added by
`vllm_patches`), filled about once a second and when the engine goes idle. A stat-logger
plugin (entry point `vllm.stat_logger_plugins`) in the API server keeps the latest
snapshot per engine and a collector on vLLM's registry exposes them, labelled with the
engine index, so data-parallel engines never mix.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_dspark.scheduling.stats import DSparkStats

STATS_FIELD = "vllm_dspark"


def attach_stats(scheduler_stats: Any, stats: DSparkStats) -> None:
    """Put a snapshot of the plugin's stats into vLLM's scheduler stats message."""
    setattr(scheduler_stats, STATS_FIELD, stats.to_dict())


def metric_families(snapshots: dict[int, DSparkStats]) -> list:
    """Prometheus metric families for the latest snapshot of each engine."""
    families: dict[str, Any] = {}
    for engine, stats in sorted(snapshots.items()):
        for family in _engine_families(engine, stats):
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    return list(families.values())


def _engine_families(engine: int, stats: DSparkStats) -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["engine", "policy"]
    values = [str(engine), stats.policy]
    families = []
    for name, doc, value in [
        ("proposed_draft_tokens", "Draft tokens proposed by the drafter", stats.proposed),
        ("verified_draft_tokens", "Draft tokens the policy sent to verification", stats.verified),
        ("pruned_draft_tokens", "Draft tokens the policy dropped before verification", stats.pruned),
        ("accepted_draft_tokens", "Verified draft tokens the target accepted", stats.accepted),
        ("predicted_accepted_draft_tokens", "Accepted drafts predicted by confidences", stats.predicted_accepted),
        ("invalid_confidences", "NaN or out-of-range confidences replaced by 0", stats.invalid_confidences),
        ("lm_head_rows", "(request, position) rows of the drafter's LM head computed", stats.lm_head_rows),
        ("drafting_seconds", "Seconds the drafter spent proposing", stats.drafting_seconds),
        ("vetoed_steps", "Steps not speculating because speculative steps at that load measured slower than plain ones",
         stats.vetoed_steps),
        ("reference_steps", "Plain steps taken so that a load where every step verified has a plain reference",
         stats.reference_steps),
        ("drafter_vetoed_steps", "Steps not drafting because the hybrid's steps measured slower than steps "
         "without the drafter", stats.drafter_vetoed_steps),
        ("drafter_reference_steps", "Steps not drafting so that the hybrid's steps can be compared with steps "
         "without the drafter", stats.drafter_reference_steps),
        ("drafter_skipped_steps", "Steps the drafter was left out, predicted faster with n-gram continuations alone",
         stats.drafter_skipped_steps),
        ("requests_without_drafter", "Requests admitted without the drafter: it measured no gain at their load",
         stats.requests_without_drafter),
    ]:
        family = CounterMetricFamily(f"vllm_dspark_{name}", doc, labels=labels)
        family.add_metric(values, value)
        families.append(family)
    by_source = CounterMetricFamily(
        "vllm_dspark_source_draft_tokens",
        "Draft tokens by proposal source (drafter, ngram) and stage (proposed, verified, accepted)",
        labels=[*labels, "source", "stage"],
    )
    for source, proposed, verified, accepted in [
        ("drafter", stats.proposed - stats.ngram_proposed, stats.verified - stats.ngram_verified,
         stats.accepted - stats.ngram_accepted),
        ("ngram", stats.ngram_proposed, stats.ngram_verified, stats.ngram_accepted),
    ]:
        for stage, value in (("proposed", proposed), ("verified", verified), ("accepted", accepted)):
            by_source.add_metric([*values, source, stage], value)
    families.append(by_source)
    gauge = GaugeMetricFamily(
        "vllm_dspark_calibration_error",
        "Mean predicted survival minus observed acceptance over verified drafts since start",
        labels=labels,
    )
    gauge.add_metric(values, stats.calibration_error)
    families.append(gauge)
    for name, doc, value in [
        ("step_time_scale", "Learned step-time model: measured steps ~ this x the SPS profile + the offset", stats.step_time_scale),
        ("step_overhead_seconds", "Learned step-time model: seconds per step beyond the scaled SPS profile (signed)", stats.step_overhead_ms / 1000.0),
    ]:
        family = GaugeMetricFamily(f"vllm_dspark_{name}", doc, labels=labels)
        family.add_metric(values, value)
        families.append(family)
    depths = CounterMetricFamily(
        "vllm_dspark_draft_depth_steps",
        "Engine steps by the draft depth planned for them (0: drafting skipped)",
        labels=[*labels, "depth"],
    )
    for depth, count in enumerate(stats.draft_depth_counts):
        depths.add_metric([*values, str(depth)], count)
    families.append(depths)
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
    """Latest snapshot per engine index, read on each scrape; one per process."""

    def __init__(self) -> None:
        self.snapshots: dict[int, DSparkStats] = {}
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snapshots = dict(self.snapshots)
        return metric_families(snapshots)


_collector: _SnapshotCollector | None = None


def _shared_collector(registry: Any) -> _SnapshotCollector:
    global _collector
    if _collector is None:
        _collector = _SnapshotCollector()
        registry.register(_collector)
    return _collector


class DSparkMetricsLogger(StatLoggerBase):
    """vLLM stat-logger plugin (entry point `vllm.stat_logger_plugins`), one per engine:
    publishes the plugin's stats that arrive with the engine's scheduler stats."""

    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        self.collector = _shared_collector(get_prometheus_registry())

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        payload = getattr(scheduler_stats, STATS_FIELD, None)
        if payload is not None:
            with self.collector.lock:
                self.collector.snapshots[engine_idx] = DSparkStats.from_dict(payload)

    def log_engine_initialized(self) -> None:
        """The scheduler logs its own start-up line."""
