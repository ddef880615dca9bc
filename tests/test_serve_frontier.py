"""benchmarks/serve_frontier.py without an engine: its configurations and its report."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from vllm_dspark.config import PluginOptions
from vllm_dspark.scheduling.sps import SpsCurve


def load_script():
    return load_benchmark("serve_frontier")


def test_configurations_are_valid_plugin_settings():
    frontier = load_script()
    configs = frontier.configurations("DRAFTER", 7, reduced="REDUCED")
    assert {"no-spec", "ngram-k3", "fixed-k1 (MTP-1-like)", "fixed-k7", "dspark", "dspark_async",
            "dspark, drafting all K", "dspark, reduced vocabulary"} <= configs.keys()
    for name, settings in configs.items():
        plugin = settings.get("additional_config")
        if plugin is not None:
            options = PluginOptions.from_additional_config(plugin)  # raises on a bad setting
            assert settings["speculative_config"]["method"] == "vllm_dspark", name
            assert options.adaptive_drafting == ("drafting all K" not in name)
            assert options.context_projection == ("float32" if "context projection in float32" in name else "auto")
            assert (settings["speculative_config"]["model"] == "REDUCED") == ("reduced" in name)
            assert options.hybrid_ngram == ("n-gram" in name)
            assert options.drafter_admission == ("drafter admission" in name)
            if options.policy != "fixed":  # priced on the engine's own start-up profile, as served
                assert (options.sps_profile, options.profile_at_startup) == ("auto", True), name
    pinned = frontier.configurations("DRAFTER", 7, frontier.curve_options("prof.json"))["dspark"]["additional_config"]
    assert pinned["vllm_dspark"]["sps_profile"] == str(Path("prof.json").resolve())


def test_report_has_every_row(tmp_path: Path):
    frontier = load_script()
    row = {"concurrency": 4, "wave_seconds": 2.0, "throughput_tok_s": 96.0, "per_user_tok_s": 24.0,
           "decode_tok_s_per_user": 30.0, "slowest_decode_tok_s": 29.0, "first_token_s": 0.25, "verified_drafts_per_step": 3.0, "accepted_length": 1.5, "per_user_spread": [20.0, 25.0],
           "turns_per_user_tok_s": [24.0, 25.0, 20.0]}
    drafted = {**row, "per_user_tok_s": 12.0, "decode_tok_s_per_user": 45.0, "steps_without_drafting": 0.5, "mean_draft_depth": 1.25,
               "drafting_ms_per_step": 3.5, "steps_vetoed": 0.25, "steps_drafter_vetoed": 0.125, "engine_steps": 32, "tokens": 192, "draft_tokens": 96,
               "step_time_scale": 1.25, "step_overhead_ms": -4.0, "drafter_verified_per_step": 1.5,
               "drafter_accepted_per_step": 0.5, "ngram_verified_per_step": 2.0, "ngram_accepted_per_step": 1.25,
               "turns_per_user_tok_s": [12.0, 25.0, 15.0]}  # paired speed-ups 0.5, 1.0, 0.75
    results = {"no-spec": [row], "dspark": [drafted]}
    # Step times 0.1 s at B = 1 and 0.2 s at B = 8: 1.5 tokens per request per step with 3
    # drafts per step predict 1.5 * T(4) / T(7) = 1.5 * (1 + 3/7) / (1 + 6/7) = 1.15x.
    meta = {"target": "T", "drafter": "D", "k": 7, "max_tokens": 48, "sps": [[1, 10.0], [8, 5.0]], "hardware": "cpu", "date": "now"}
    frontier.write_results(results, meta, tmp_path / "frontier")
    assert json.loads((tmp_path / "frontier.json").read_text())["results"] == results
    table = (tmp_path / "frontier.md").read_text()
    assert "| no-spec | 4 | 96.0 | 24.00 (20.00-25.00) | 1.00x | 1.00x (1.00-1.00) | - | 30.00 | 1.00x | 29.00 | 0.250 | 1.50 | 3.00 | - | - | - | - | - |" in table
    assert "| dspark | 4 | 96.0 | 12.00 (20.00-25.00) | 0.50x | 0.75x (0.50-1.00) | 1.15x | 45.00 | 1.50x | 29.00 | 0.250 | 1.50 | 3.00 | 50% (25%; 12%) | 1.25 | 3.5 | 0.50 / 1.50; 1.25 / 2.00 | 1.25 x profile -4.0 ms |" in table
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_prompt_sets_split_code_and_chat():
    frontier = load_script()
    code, chat = frontier.eval_prompts(200, "code"), frontier.eval_prompts(200, "chat")
    assert len(code) == len(chat) == 200  # repeated past the end of a file
    assert not {p[0]["content"] for p in code} & {p[0]["content"] for p in chat}
    assert len(frontier.eval_prompts(6)) == 6


def test_each_repeat_takes_the_next_prompts():
    frontier = load_script()
    first_six = frontier.eval_prompts(6)
    assert frontier.eval_prompts(2, offset=2) + frontier.eval_prompts(2, offset=4) == first_six[2:]
    assert len({p[0]["content"] for p in first_six}) == 6  # round-robin over three files, no repeats yet
    chat = frontier.eval_prompts(80, "chat")
    assert frontier.eval_prompts(3, "chat", offset=79) == [chat[79], chat[0], chat[1]]  # wraps past the file's end


def test_waves_are_interleaved_in_rotating_order():
    frontier = load_script()
    names = ["a", "b", "c"]
    assert [frontier.wave_order(names, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    before = {"spec": {"num_drafts": 10, "num_accepted_tokens": 5, "num_draft_tokens": 20}, "plugin": None}
    waves = [{"seconds": s, "decode": d, "slowest_decode": d - 1, "first_token_s": 0.1, "tokens": 64, "plugin": None,
              "user_tok_s": [d, d + 1], "user_first_token_s": [0.1, d], "user_queue_s": [0.0, s],
              "spec": {"num_drafts": 30, "num_accepted_tokens": 25, "num_draft_tokens": 60}}
             for s, d in ((2.0, 9.0), (4.0, 7.0), (3.0, 8.0))]
    row = frontier.summarize_waves(1, 64, waves, before)
    assert row["wave_seconds"] == 3.0 and row["per_user_tok_s"] == 64 / 3.0 and row["decode_tok_s_per_user"] == 8.0
    assert row["accepted_length"] == 1.0 + 20 / 20 and row["verified_drafts_per_step"] == 2.0
    assert row["per_user_spread"] == [16.0, 32.0] and row["turns_per_user_tok_s"] == [32.0, 16.0, 64 / 3.0]
    assert row["requests_tok_s"] == [9.0, 10.0, 7.0, 8.0, 8.0, 9.0]  # turn by turn, each in request order
    assert row["requests_first_token_s"] == [0.1, 9.0, 0.1, 7.0, 0.1, 8.0]
    assert row["requests_queue_s"] == [0.0, 2.0, 0.0, 4.0, 0.0, 3.0]
    # a closed loop's turns are rated by their median request, not by their wall time
    loops = [wave | {"median_user_tok_s": speed} for wave, speed in zip(waves, (20.0, 30.0, 10.0))]
    assert frontier.summarize_waves(1, 64, loops, before, requests_per_user=3)["per_user_tok_s"] == 20.0


def test_closed_loops_vary_output_lengths_per_prompt():
    frontier = load_script()
    assert frontier.output_lengths(64, 3, 10, varied=False) == [64, 64, 64]
    lengths = frontier.output_lengths(64, 200, 0, varied=True)
    assert min(lengths) >= 32 and max(lengths) <= 96 and len(set(lengths)) > 20
    assert 56 <= sum(lengths) / len(lengths) <= 72  # about max_tokens on average
    assert frontier.output_lengths(64, 5, 3, varied=True) == lengths[3:8]  # a prompt's length is its own


class FakeLLM:
    """An engine whose request i finishes after `lengths[i]` steps, one token a step: what
    `serve_turn` needs of vLLM's LLM (enqueue_chat, llm_engine.step)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.running, self.counter, self.most_in_flight = lengths, {}, 0, 0
        self.llm_engine = self

    def enqueue_chat(self, conversations, params, use_tqdm):
        [conversation] = conversations
        assert params == ("params of", conversation)
        request_id = str(self.counter)
        self.counter += 1
        self.running[request_id] = [self.lengths[conversation], 0]
        self.most_in_flight = max(self.most_in_flight, len(self.running))
        return [f"{request_id}-a1b2c3d4"]  # vLLM's internal id: the counter plus a random suffix

    def step(self):
        from types import SimpleNamespace

        outputs = []
        for request_id, progress in list(self.running.items()):
            progress[1] += 1
            finished = progress[1] == progress[0]
            if finished:
                del self.running[request_id]
            index = int(request_id)  # requests are admitted in order here
            metrics = SimpleNamespace(first_token_ts=0.0, last_token_ts=float(progress[1]),
                                      first_token_latency=0.5 + index / 10, queued_ts=1.0, scheduled_ts=1.0 + index / 100)
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, metrics=metrics,
                                           outputs=[SimpleNamespace(token_ids=[0] * progress[1])]))
        return outputs


def test_a_closed_loop_replaces_each_finished_request_at_once():
    frontier = load_script()
    lengths = [2, 8, 2, 2, 2, 2]  # request 1 is slow: the others pass it by
    llm = FakeLLM(lengths)
    turn = frontier.serve_turn(llm, [(i, ("params of", i)) for i in range(6)], concurrency=2)
    assert llm.most_in_flight == 2 and llm.counter == 6 and not llm.running
    assert turn["tokens"] == sum(lengths)
    # a fake request's decode speed is (tokens - 1) / its steps: 1/2 for the short ones, 7/8 for request 1
    assert turn["median_user_tok_s"] > 0 and turn["first_token_s"] == pytest.approx(0.75)
    # every request's speed, first token and queue wait at its own place, whatever order they finished in
    assert len(turn["user_tok_s"]) == 6 and all(speed > 0 for speed in turn["user_tok_s"])
    assert turn["user_first_token_s"] == pytest.approx([0.5 + i / 10 for i in range(6)])
    assert turn["user_queue_s"] == pytest.approx([i / 100 for i in range(6)])
    assert turn["median_user_tok_s"] == statistics.median(turn["user_tok_s"])
    assert turn["decode"] == pytest.approx((5 * 0.5 + 7 / 8) / 6)
    assert turn["slowest_decode"] == pytest.approx(0.5)
    # a wave of the same six requests keeps them all in flight
    wave = FakeLLM(lengths)
    frontier.serve_turn(wave, [(i, ("params of", i)) for i in range(6)], concurrency=6)
    assert wave.most_in_flight == 6


def test_drafting_breakdown_rows_name_the_drafter_they_serve(tmp_path: Path):
    breakdown = load_benchmark("drafting_breakdown")
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"draft_vocab_size": 4096}))
    rows = breakdown.configurations(str(served), "FULL", 7)
    assert list(rows) == [label.format(vocab=4096) for label, _, _ in breakdown.ROWS]
    models = {name: row.get("speculative_config", {}).get("model") for name, row in rows.items()}
    assert models["full vocabulary, drafting all K (where it started)"] == "FULL"
    assert models["4096-word vocabulary, adaptive drafting (served)"] == str(served)
    assert PluginOptions.from_additional_config(rows["4096-word vocabulary, drafting all K"]["additional_config"]).adaptive_drafting is False
    float32_context = PluginOptions.from_additional_config(rows[breakdown.REDUCED_ALL_K_FLOAT32_CONTEXT.format(vocab=4096)]["additional_config"])
    assert (float32_context.adaptive_drafting, float32_context.context_projection) == (False, "float32")
    without_full = breakdown.configurations(str(served), None, 7)
    assert not any(name.startswith("full vocabulary") for name in without_full)


def test_drafting_breakdown_lever_rows_read_the_measured_rows():
    breakdown = load_benchmark("drafting_breakdown")
    rows = {
        breakdown.FULL_ALL_K: {"step": 90.0, "drafting total": 44.0, "LM head": 33.0, "Markov bias": 3.0, "context K/V": 1.0,
                               "rejection sampler": 1.0, "sampling etc.": 2.0},
        breakdown.REDUCED_ALL_K.format(vocab="4096"): {"step": 60.0, "drafting total": 8.0, "LM head": 1.5, "Markov bias": 0.4,
                                                      "context K/V": 1.0, "rejection sampler": 1.0, "sampling etc.": 0.9},
        breakdown.SERVED.format(vocab="4096"): {"step": 50.0, "drafting total": 5.0, "LM head": 0.5, "Markov bias": 0.1,
                                               "context K/V": 1.0, "rejection sampler": 0.6, "sampling etc.": 0.3},
    }
    lines = breakdown.lever_rows(rows, "4096", 0.11)
    text = "\n".join(lines)
    assert "LM head 33.0 -> 1.5 ms, drafting 44.0 -> 8.0 ms" in text  # built: the pair of rows it separates
    assert "drafting 8.0 -> 5.0 ms per step (full vocabulary: not run)" in text
    assert "at most its whole bias: 0.10 ms served, 0.40 ms with all K drafted" in text  # not built: its bound
    assert "at most 0.11 ms" in text
    assert not any("deferred context" in line for line in lines)  # its two floor rows were not measured
    assert not any("bfloat16" in line for line in lines)
    rows[breakdown.REDUCED_ALL_K_FLOAT32_CONTEXT.format(vocab="4096")] = {"step": 63.0, "drafting total": 10.5, "context K/V": 3.5}
    assert "context K/V 3.50 -> 1.00 ms, drafting 10.50 -> 8.00 ms, step 63.0 -> 60.0 ms (all K drafted)" in "\n".join(breakdown.lever_rows(rows, "4096", None))
    assert not any("allocations" in line for line in breakdown.lever_rows(rows, "4096", None))


def test_openmp_rows_are_compared_with_plain_decoding_under_their_runtime(monkeypatch, tmp_path: Path):
    frontier = load_script()
    library = tmp_path / "lib" / "libiomp5.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    monkeypatch.setattr(frontier.sys, "prefix", str(tmp_path))
    plan = {"no-spec": {}, "dspark": {"speculative_config": {"method": "vllm_dspark"}}}
    assert frontier.with_openmp(plan, "inherit") == plan
    both = frontier.with_openmp(plan, "both")
    assert both["dspark, Intel OpenMP"] == plan["dspark"] | {"environment": {"LD_PRELOAD": str(library)}}
    assert both["dspark, GNU OpenMP"]["environment"] == {"LD_PRELOAD": ""}
    assert {name: frontier.baseline_name(name) for name in both} == {
        "no-spec, GNU OpenMP": "no-spec, GNU OpenMP", "no-spec, Intel OpenMP": "no-spec, Intel OpenMP",
        "dspark, GNU OpenMP": "no-spec, GNU OpenMP", "dspark, Intel OpenMP": "no-spec, Intel OpenMP"}
    assert set(frontier.with_openmp(plan, "intel")) == {"no-spec", "dspark"}
    assert frontier.baseline_name("dspark") == "no-spec"
    library.unlink()
    with pytest.raises(SystemExit, match="no Intel OpenMP runtime"):
        frontier.with_openmp(plan, "intel")
    assert frontier.with_openmp(plan, "gnu")["dspark"]["environment"] == {"LD_PRELOAD": ""}  # needs no libiomp5


def test_an_engine_starts_with_its_environment_and_the_parent_keeps_its_own(monkeypatch):
    frontier = load_script()
    monkeypatch.setenv("LD_PRELOAD", "parent.so")
    monkeypatch.delenv("DSPARK_TEST_ONLY", raising=False)
    with frontier.patched_environment({"LD_PRELOAD": "", "DSPARK_TEST_ONLY": "1"}):
        assert frontier.os.environ["LD_PRELOAD"] == "" and frontier.os.environ["DSPARK_TEST_ONLY"] == "1"
    assert frontier.os.environ["LD_PRELOAD"] == "parent.so" and "DSPARK_TEST_ONLY" not in frontier.os.environ


def test_a_commit_runs_beside_the_working_tree(tmp_path: Path):
    """--baseline-commit: every plugin row twice, the twin with that commit's plugin first
    on the engine's sys.path, compared with the same plain row."""
    frontier = load_script()
    plugin = frontier.plugin_at_commit("HEAD", tmp_path)
    assert (plugin / "vllm_dspark" / "scheduling" / "policies.py").is_file()
    assert (plugin / "vllm_dspark" / "kernels" / "__init__.py").is_file()
    plan = {"no-spec": {}, "ngram-k3": {"speculative_config": {"method": "ngram"}},
            "dspark": {"speculative_config": {"method": "vllm_dspark"}}}
    both = frontier.with_commit(plan, "abc123", plugin)
    assert list(both) == ["no-spec", "ngram-k3", "dspark", "dspark @ abc123"]
    assert both["dspark @ abc123"] == plan["dspark"] | {"plugin_path": str(plugin)}
    assert frontier.baseline_name("dspark @ abc123") == "no-spec"


def test_a_second_profile_prices_a_twin_of_every_row_that_prices_drafts(tmp_path: Path):
    """--compare-profile: every row on the start-up curve twice, the twin pinned to the file;
    rows that price nothing (plain, vLLM's n-gram, fixed k) are not doubled."""
    frontier = load_script()
    dense = tmp_path / "dense.json"
    SpsCurve(points=[(1, 30.0), (8, 28.0), (16, 20.0)]).save(dense)
    plan = {name: settings for name, settings in frontier.configurations("DRAFTER", 7).items()
            if name in ("no-spec", "ngram-k3", "fixed-k3", "dspark + n-gram")}
    both = frontier.with_profile(plan, str(dense))
    assert list(both) == [*plan, "dspark + n-gram @ profile dense"]
    twin = PluginOptions.from_additional_config(both["dspark + n-gram @ profile dense"]["additional_config"])
    row = PluginOptions.from_additional_config(plan["dspark + n-gram"]["additional_config"])
    assert (twin.sps_profile, twin.profile_at_startup) == (str(dense.resolve()), False)
    assert twin.model_copy(update={"sps_profile": "auto", "profile_at_startup": True}) == row
    assert frontier.baseline_name("dspark + n-gram @ profile dense") == "no-spec"


def test_drafts_verified_and_accepted_are_split_by_source_per_step():
    """plugin_delta: one concurrency's drafts by source, per engine step; the drafter's share
    is the total less the n-gram continuations'."""
    frontier = load_script()
    zero = {"steps": 10, "depths": [10], "lm_head_rows": 0, "drafting_seconds": 0.0, "vetoed_steps": 0,
            "drafter_vetoed_steps": 0, "drafter_skipped_steps": 0, "verified": 30, "accepted": 12,
            "ngram_verified": 20, "ngram_accepted": 10}
    after = zero | {"steps": 30, "depths": [20, 10], "verified": 110, "accepted": 52, "ngram_verified": 60, "ngram_accepted": 30}
    delta = frontier.plugin_delta(zero, after)
    assert (delta["drafter_verified_per_step"], delta["drafter_accepted_per_step"]) == (2.0, 1.0)
    assert (delta["ngram_verified_per_step"], delta["ngram_accepted_per_step"]) == (2.0, 1.0)

