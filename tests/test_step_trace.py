"""benchmarks/step_trace.py without an engine: grouping steps and splitting a wave's time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script():
    sys.path.insert(0, str(REPO / "benchmarks"))  # it imports its sibling serve_frontier
    spec = importlib.util.spec_from_file_location("step_trace", REPO / "benchmarks" / "step_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(seconds: float, requests: int = 4, verified: int = 0, drafted: bool = False, prompt: int = 0) -> dict:
    return {"seconds": seconds, "requests": requests, "tokens": requests + verified + prompt,
            "verified": verified, "drafted": drafted}


def test_steps_are_grouped_by_what_they_did():
    trace = load_script()
    assert trace.step_group(step(0.04), 4) == "plain"
    assert trace.step_group(step(0.05, verified=3), 4) == "verify"
    assert trace.step_group(step(0.06, drafted=True), 4) == "draft"
    assert trace.step_group(step(0.06, verified=2, drafted=True), 4) == "draft"
    assert trace.step_group(step(0.3, prompt=100), 4) == "other", "a prefill"
    assert trace.step_group(step(0.03, requests=2), 4) == "other", "the wave's tail"


def test_a_wave_splits_into_each_groups_extra_time_and_the_steps_saved(tmp_path: Path):
    """Plain engine: 10 plain steps of 40 ms and a 300 ms prefill. Speculative: 6 plain steps
    of 41 ms, 2 verifying steps of 50 ms, 1 drafting step of 60 ms, the same prefill: one
    step saved (-40 ms), +6, +20, +20 ms."""
    trace = load_script()
    plain_wave = {"wave_seconds": 0.7, "steps": [step(0.3, prompt=100)] + [step(0.04)] * 10}
    spec_wave = {"wave_seconds": 0.65, "steps": [step(0.3, prompt=100)] + [step(0.041)] * 6
                 + [step(0.05, verified=4)] * 2 + [step(0.06, drafted=True)]}
    plain, spec = trace.summarize([plain_wave] * 3, 4), trace.summarize([spec_wave] * 3, 4)
    assert spec["groups"]["verify"]["steps_per_wave"] == 2 and spec["groups"]["plain"]["median_s"] == pytest.approx(0.041)
    split = trace.split_against_plain(spec, plain)
    assert split == pytest.approx({"plain": 0.006, "verify": 0.02, "draft": 0.02, "other": 0.0, "steps saved": -0.04})
    assert sum(split.values()) == pytest.approx(spec["step_seconds_per_wave"] - plain["step_seconds_per_wave"])
    meta = {"prompts": "chat", "concurrency": 4, "repeats": 3, "max_tokens": 11, "date": "now", "hardware": "cpu"}
    trace.write_report({"no-spec": plain, "dspark": spec}, meta, tmp_path / "trace")
    table = (tmp_path / "trace.md").read_text()
    assert "| dspark | 0.650 | 0.706 | 6.0 (41.0) | 2.0 (50.0) | 1.0 (60.0) | 1.0 (300.0) | +6 | +20 | +20 | +0 | -40 | +6 |" in table
