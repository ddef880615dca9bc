"""benchmarks/step_trace.py without an engine: grouping steps and splitting a wave's time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark


def load_script():
    return load_benchmark("step_trace")


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


def test_prefill_steps_are_fitted_as_fixed_plus_per_token(tmp_path: Path):
    """Prefills of 100, 200 and 300 prompt tokens beside four decoding requests that verify
    2 drafts each: 20 ms + 1 ms per scheduled token, exactly."""
    trace = load_script()
    prefills = [step(0.020 + 0.001 * (4 + 8 + prompt), verified=8, prompt=prompt) for prompt in (100, 200, 300)]
    turn = {"wave_seconds": 1.0, "steps": prefills + [step(0.04)] * 5}
    row = trace.summarize([turn, turn], 4)
    fit = row["prefill"]
    assert fit["steps_per_wave"] == 3 and fit["verified"] == 8 and fit["median_tokens"] == 212
    assert fit["seconds_per_wave"] == pytest.approx(0.132 + 0.232 + 0.332)
    assert fit["fixed_s"] == pytest.approx(0.020) and fit["per_token_s"] == pytest.approx(0.001)
    assert row["groups"]["other"]["steps_per_wave"] == 3  # the prefills are still the `other` group
    one_size = trace.fit_prefill([prefills[0]] * 2, 1)
    assert one_size["fixed_s"] is None and one_size["median_s"] == pytest.approx(0.132)
    meta = {"prompts": "code", "concurrency": 4, "repeats": 2, "max_tokens": 64, "date": "now", "hardware": "cpu",
            "requests_per_user": 3}
    trace.write_report({"dspark + n-gram": row}, meta, tmp_path / "trace")
    report = (tmp_path / "trace.md").read_text()
    assert "closed-loop turns (3 requests per user" in report and "32-96 tokens" in report
    assert "| dspark + n-gram | 3.0 | 0.70 | 232.0 | 212 | 20.0 | 1.00 | 8.0 |" in report


def test_full_load_steps_split_into_the_engines_parts(tmp_path: Path):
    """Two verifying steps of 50 ms whose timed parts sum to 45 and 41 ms, one plain step
    without parts recorded, a prefill (not a full-load step): the verify group's mean per
    part, a part a step did not call counted as 0, and the rest of the step."""
    trace = load_script()
    verifying = [step(0.05, verified=3) | {"parts": {"_model_forward": 0.040, "schedule": 0.005}},
                 step(0.05, verified=3) | {"parts": {"_model_forward": 0.038, "schedule": 0.001, "_sample": 0.002}}]
    wave = {"wave_seconds": 0.5, "steps": [step(0.3, prompt=100) | {"parts": {"_model_forward": 0.29}},
                                           step(0.04) | {"parts": {}}] + verifying}
    row = trace.summarize([wave], 4)
    verify = row["parts"]["verify"]
    assert verify["_model_forward"] == pytest.approx(0.039) and verify["schedule"] == pytest.approx(0.003)
    assert verify["_sample"] == pytest.approx(0.001) and verify["take_draft_token_ids"] == 0.0
    assert verify["rest"] == pytest.approx(0.007)
    assert set(row["parts"]) == {"plain", "verify"} and row["parts"]["plain"]["rest"] == pytest.approx(0.04)
    meta = {"prompts": "chat", "concurrency": 4, "repeats": 1, "max_tokens": 11, "date": "now", "hardware": "cpu"}
    trace.write_report({"dspark": row}, meta, tmp_path / "trace")
    table = (tmp_path / "trace.md").read_text()
    assert "| dspark | verify | 3.00 | 0.00 | 0.00 | 0.00 | 39.00 | 0.00 | 1.00 | 0.00 | 0.00 | 7.00 |" in table

