"""The scheduler-overhead benchmark times what the engine's plugin really does each step."""

from __future__ import annotations

import numpy as np

from tests.benchmark_scripts import load_benchmark
from vllm_dspark.scheduling import hybrid


def test_the_hybrid_step_drives_every_part_of_the_engines_step(monkeypatch) -> None:
    """Its step verifies drafter blocks and n-gram continuations both, and weighs the
    drafter skip on most steps (so the skip's quantiles and pass prices are in the time)."""
    benchmark = load_benchmark("scheduler_overhead")
    weighed, applies = [], hybrid.DrafterSkip.applies
    monkeypatch.setattr(hybrid.DrafterSkip, "applies",
                        lambda self, proposals, greedy: weighed.append(True) or applies(self, proposals, greedy))
    step, controller = benchmark.hybrid_step(8)
    rng = np.random.default_rng(0)
    for _ in range(200):
        step(rng.uniform(0.5, 0.95, size=(8, benchmark.BLOCK)))
    stats = controller.stats
    assert stats.ngram_verified > 0 and stats.verified > stats.ngram_verified, stats.summary()
    assert len(weighed) > 100
