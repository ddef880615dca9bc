"""benchmarks/pareto.py without a server: its dataset, its sweep parameters, its summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from vllm_dspark.config import PluginOptions

REPO = Path(__file__).resolve().parents[1]


def load_script():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("pareto", REPO / "benchmarks" / "pareto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dataset_is_vllm_custom_format_with_corpus_lengths(tmp_path: Path):
    pareto = load_script()
    out = pareto.write_dataset("code", tmp_path / "code.jsonl", max_output=200)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 164  # every humaneval prompt
    assert all(set(r) == {"prompt", "output_tokens"} and 1 <= r["output_tokens"] <= 200 for r in rows)
    assert len({r["output_tokens"] for r in rows}) > 10  # lengths vary like the target's own


def test_every_row_is_a_valid_server_configuration():
    pareto = load_script()
    params = pareto.serve_params(pareto.ROWS, "DRAFTER", None, 7)
    assert list(params) == pareto.ROWS and params["no-spec"] == {}
    for name, overrides in params.items():
        if "additional_config" in overrides:
            PluginOptions.from_additional_config(json.loads(overrides["additional_config"]))
            assert json.loads(overrides["speculative_config"])["method"] == "vllm_dspark", name


def test_summary_matches_results_to_configurations(tmp_path: Path):
    pareto = load_script()
    params = pareto.serve_params(["no-spec", pareto.MTP1, "dspark"], "DRAFTER", None, 7)
    for i, (name, throughput) in enumerate([("no-spec", 40.0), (pareto.MTP1, 32.0), ("dspark", 60.0)]):
        run = {"max_concurrency": 4, "output_throughput": throughput, "median_ttft_ms": 100.0, "median_tpot_ms": 50.0,
               "_benchmark_name": "users-4", **params[name]}
        if name != "no-spec":
            run["spec_decode_acceptance_length"] = 1.5
        (tmp_path / f"comb{i}").mkdir()
        (tmp_path / f"comb{i}" / "run=0.json").write_text(json.dumps(run))
    table = pareto.summarize(tmp_path, params)
    assert "| dspark | 4 | 60.0 | 15.00 | 1.88x | 1.50x | 1.50 | 100 | 50.0 |" in table
    assert "| no-spec | 4 | 40.0 | 10.00 | 1.25x | 1.00x | nan |" in table
