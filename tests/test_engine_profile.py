"""`vllm-dspark profile`: a real SPS(B) curve from engine steps, and its use by the plugin."""

from __future__ import annotations

import json

import pytest

from tests.tiny_models import engine_scheduler, make_drafter, make_llm
from vllm_dspark import engine_profile
from vllm_dspark.engine_profile import (
    ensure_cached_profile,
    monotone_step_times,
    plot_curve,
    profile_engine,
    profile_kv_cache_bytes,
    startup_batch_tokens,
)
from vllm_dspark.scheduling import SpsCurve
from vllm_dspark.scheduling.profiles import cached_profile_path, profile_key


@pytest.fixture(scope="module")
def tiny_curve(tiny_target) -> SpsCurve:
    return profile_engine(
        str(tiny_target), [1, 2, 4], context_len=24, steps=3, distributed_executor_backend="uni"
    )


def test_profile_measures_every_batch_size(tiny_curve: SpsCurve, tiny_target, tmp_path):
    assert [b for b, _ in tiny_curve.points] == [1, 2, 4]
    sps = [s for _, s in tiny_curve.points]
    assert all(s > 0 for s in sps)
    assert all(a >= b for a, b in zip(sps, sps[1:])), "more tokens per pass never run more steps/s"
    assert tiny_curve.metadata["model"] == str(tiny_target.resolve())
    assert {"dtype", "hardware", "vllm_version", "context_len"} <= tiny_curve.metadata.keys()
    out = tmp_path / "curve.json"
    tiny_curve.save(out)
    assert SpsCurve.load(out) == tiny_curve
    plot_curve(tiny_curve, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_profile_asks_for_the_kv_cache_it_needs_not_a_share_of_memory(tiny_target):
    """The start-up profile must start beside other engines (the default would reserve 92%
    of a CPU machine's memory): it asks for its batch's KV cache with a margin."""
    config = json.loads((tiny_target / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    needed = per_token * 4 * 256  # 4 requests of 200 tokens in 128-token blocks
    asked = profile_kv_cache_bytes(str(tiny_target), 4, 200, "float32")
    assert needed < asked < 2 * needed + (64 << 20)
    assert profile_kv_cache_bytes(str(tiny_target), 64, 200, "float32") > 8 * needed


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),  # already monotone: untouched
        ([1.0, 3.0, 2.0, 4.0], [1.0, 2.5, 2.5, 4.0]),  # one inversion: the pair is averaged
        ([5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]),  # a slow first point is pooled, not carried
        ([3.0, 2.0, 1.0], [2.0, 2.0, 2.0]),
    ],
)
def test_monotone_step_times_pools_violators(measured, expected):
    assert monotone_step_times(measured).tolist() == pytest.approx(expected)


def test_profile_file_validation(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": [[4, 1.0], [2, 2.0]]}))
    with pytest.raises(ValueError, match="strictly increasing"):
        SpsCurve.load(bad)
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="not a valid SPS profile"):
        SpsCurve.load(bad)


def test_auto_profile_is_used_or_falls_back(tiny_target, tiny_curve, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_CACHE", str(tmp_path / "cache"))
    drafter = make_drafter(tiny_target, tmp_path / "drafter")
    spec = {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": 4}
    options = {"vllm_dspark": {"policy": "dspark", "sps_profile": "auto"}}

    llm = make_llm(tiny_target, spec, options)
    scheduler = engine_scheduler(llm)
    assert scheduler.controller.curve is None and scheduler.controller.policy.name == "fixed"
    del llm, scheduler

    cached = cached_profile_path(profile_key(str(tiny_target), "float32"))
    cached.parent.mkdir(parents=True)
    tiny_curve.save(cached)
    llm = make_llm(tiny_target, spec, options)
    scheduler = engine_scheduler(llm)
    assert scheduler.controller.curve == tiny_curve and scheduler.controller.policy.name == "dspark"


def test_profile_at_startup_fills_the_cache(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_CACHE", str(tmp_path / "cache"))
    drafter = make_drafter(tiny_target, tmp_path / "drafter")
    spec = {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": 4}
    options = {"vllm_dspark": {"policy": "dspark", "sps_profile": "auto", "profile_at_startup": True}}
    llm = make_llm(tiny_target, spec, options, max_num_seqs=2)
    scheduler = engine_scheduler(llm)
    assert scheduler.controller.policy.name == "dspark"
    assert [b for b, _ in scheduler.controller.curve.points] == [1, 4, 10], "up to 2 requests x (1 + K) tokens"
    assert cached_profile_path(profile_key(str(tiny_target), "float32")).is_file()


@pytest.mark.parametrize(("max_num_seqs", "k", "expected"), [(1, 0, [1]), (1, 7, [1, 4, 8]), (2, 4, [1, 4, 10]),
                                                             (16, 7, [1, 4, 16, 64]), (256, 7, [1, 4, 16, 64])])
def test_startup_profile_reaches_the_engines_largest_pass(max_num_seqs, k, expected):
    assert startup_batch_tokens(max_num_seqs, k) == expected


def test_a_cached_profile_too_short_for_this_engine_is_measured_again(tmp_path, monkeypatch):
    """A profile cached by a one-request engine must not leave a 16-request engine a flat
    curve (verification priced free at every load): it is measured again up to 64 tokens;
    one that reaches far enough is reused."""
    monkeypatch.setenv("VLLM_DSPARK_CACHE", str(tmp_path / "cache"))
    path = cached_profile_path(profile_key("some-model", "float32"))
    path.parent.mkdir(parents=True)
    SpsCurve(points=[(1, 40.0)]).save(path)
    commands = []
    monkeypatch.setattr(engine_profile.subprocess, "run", lambda command, **_: commands.append(command))

    assert ensure_cached_profile("some-model", "float32", max_num_seqs=1, num_speculative_tokens=0) == path
    assert commands == [], "a one-token profile reaches a one-request engine without drafts"
    ensure_cached_profile("some-model", "float32", max_num_seqs=16, num_speculative_tokens=7)
    (command,) = commands
    sizes = command[command.index("--batch-tokens") + 1:command.index("--context-len")]
    assert sizes == ["1", "4", "16", "64"] and command[command.index("--out") + 1] == str(path)

    SpsCurve(points=[(1, 40.0), (4, 38.0), (16, 25.0), (64, 8.0)]).save(path)
    ensure_cached_profile("some-model", "float32", max_num_seqs=256, num_speculative_tokens=7)
    assert len(commands) == 1, "a profile up to the start-up cap is reused by any larger engine"
    path.write_text("{not json")
    with pytest.raises(Exception, match="cached SPS profile .* is unusable"):
        ensure_cached_profile("some-model", "float32", max_num_seqs=1, num_speculative_tokens=0)
