"""benchmarks/serve_frontier.py without an engine: its configurations and its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from vllm_dspark.config import PluginOptions

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("serve_frontier", REPO / "benchmarks" / "serve_frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configurations_are_valid_plugin_settings():
    frontier = load_script()
    configs = frontier.configurations("DRAFTER", 7, frontier.DEFAULT_SPS, reduced="REDUCED")
    assert {"no-spec", "ngram-k3", "fixed-k1 (MTP-1-like)", "fixed-k7", "dspark", "dspark_async",
            "dspark, drafting all K", "dspark, reduced vocabulary"} <= configs.keys()
    for name, settings in configs.items():
        plugin = settings.get("additional_config")
        if plugin is not None:
            options = PluginOptions.from_additional_config(plugin)  # raises on a bad setting
            assert settings["speculative_config"]["method"] == "vllm_dspark", name
            assert options.adaptive_drafting == (name != "dspark, drafting all K")
            assert (settings["speculative_config"]["model"] == "REDUCED") == ("reduced" in name)
            assert options.hybrid_ngram == ("n-gram" in name)


def test_report_has_every_row(tmp_path: Path):
    frontier = load_script()
    row = {"concurrency": 4, "wave_seconds": 2.0, "throughput_tok_s": 96.0, "per_user_tok_s": 24.0,
           "decode_tok_s_per_user": 30.0, "verified_drafts_per_step": 3.0, "accepted_length": 1.5, "wave_spread_seconds": [1.92, 2.4]}
    drafted = {**row, "per_user_tok_s": 12.0, "decode_tok_s_per_user": 45.0, "steps_without_drafting": 0.5, "mean_draft_depth": 1.25,
               "drafting_ms_per_step": 3.5}
    results = {"no-spec": [row], "dspark": [drafted]}
    meta = {"target": "T", "drafter": "D", "k": 7, "max_tokens": 48, "sps": [], "hardware": "cpu", "date": "now"}
    frontier.write_results(results, meta, tmp_path / "frontier")
    assert json.loads((tmp_path / "frontier.json").read_text())["results"] == results
    table = (tmp_path / "frontier.md").read_text()
    assert "| no-spec | 4 | 96.0 | 24.00 (20.00-25.00) | 1.00x | 30.00 | 1.00x | 1.50 | 3.00 | - | - | - |" in table
    assert "| dspark | 4 | 96.0 | 12.00 (20.00-25.00) | 0.50x | 45.00 | 1.50x | 1.50 | 3.00 | 50% | 1.25 | 3.5 |" in table
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_prompt_sets_split_code_and_chat():
    frontier = load_script()
    code, chat = frontier.eval_prompts(200, "code"), frontier.eval_prompts(200, "chat")
    assert len(code) == len(chat) == 200  # repeated past the end of a file
    assert not {p[0]["content"] for p in code} & {p[0]["content"] for p in chat}
    assert len(frontier.eval_prompts(6)) == 6


def test_waves_are_interleaved_in_rotating_order():
    frontier = load_script()
    names = ["a", "b", "c"]
    assert [frontier.wave_order(names, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    before = {"spec": {"num_drafts": 10, "num_accepted_tokens": 5, "num_draft_tokens": 20}, "plugin": None}
    waves = [{"seconds": s, "decode": d, "tokens": 64, "plugin": None,
              "spec": {"num_drafts": 30, "num_accepted_tokens": 25, "num_draft_tokens": 60}} for s, d in ((2.0, 9.0), (4.0, 7.0), (3.0, 8.0))]
    row = frontier.summarize_waves(1, 64, waves, before)
    assert row["wave_seconds"] == 3.0 and row["per_user_tok_s"] == 64 / 3.0 and row["decode_tok_s_per_user"] == 8.0
    assert row["accepted_length"] == 1.0 + 20 / 20 and row["verified_drafts_per_step"] == 2.0
    assert row["wave_spread_seconds"] == [2.0, 4.0]
