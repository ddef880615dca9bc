"""benchmarks/pareto.py without a server: its dataset, its sweep parameters, its summary."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_scripts import load_benchmark
from vllm_dspark.config import PluginOptions


def load_script():
    return load_benchmark("pareto")


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
    assert "| dspark | 4 | 60.0 | 15.00 | 1.88x | 1.50x | 1.50 | 100 | 50.0 | - | - | - |" in table
    assert "| no-spec | 4 | 40.0 | 10.00 | 1.25x | 1.00x | nan |" in table


def snapshot(start: float, skipped: float, drafted: float, requests: float, verified: float) -> dict[str, float]:
    """Plugin metrics as `/metrics` shows them (cumulative since the server started)."""
    labels = 'engine="0",policy="dspark"'
    return {
        "process_start_time_seconds": start,
        f'vllm_dspark_draft_depth_steps_total{{depth="0",{labels}}}': skipped,
        f'vllm_dspark_draft_depth_steps_total{{depth="3",{labels}}}': drafted,
        f"vllm_dspark_verification_budget_count{{{labels}}}": requests,
        f"vllm_dspark_verification_budget_sum{{{labels}}}": verified,
        f"vllm_dspark_step_time_scale{{{labels}}}": 1.5,
        f"vllm_dspark_step_overhead_seconds{{{labels}}}": 0.004,
    }


def test_controller_columns_are_per_run_differences_on_one_server():
    pareto = load_script()
    columns = pareto.controller_columns([
        (16, snapshot(1.0, skipped=90, drafted=20, requests=100, verified=50)),
        (4, snapshot(1.0, skipped=10, drafted=10, requests=40, verified=40)),
        (64, snapshot(2.0, skipped=30, drafted=10, requests=10, verified=3)),  # a restarted server
    ])
    assert columns[4] == ("50%", "1.00", "1.50x +4 ms")
    assert columns[16] == ("11%", "0.17", "1.50x +4 ms")  # 80 skipped, 10 drafted; 10 of 60
    assert columns[64] == ("25%", "0.30", "1.50x +4 ms")
    assert pareto.controller_columns([(1, {"process_start_time_seconds": 1.0})]) == {}


def test_after_bench_hook_stores_the_plugin_metrics_beside_the_newest_run(tmp_path: Path):
    import http.server
    import os
    import threading

    body = b'# HELP x\nprocess_start_time_seconds 12.0\nvllm:other 3.0\nvllm_dspark_step_time_scale{engine="0",policy="dspark"} 1.25\n'

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("localhost", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for i, name in enumerate(["SERVE--a-BENCH--users-1", "SERVE--a-BENCH--users-4"]):
            (tmp_path / name).mkdir()
            run = tmp_path / name / "run=0.json"
            run.write_text("{}")
            os.utime(run, (1000 + i, 1000 + i))
        out = load_script().snapshot_plugin_metrics(server.server_port, tmp_path)
    finally:
        server.shutdown()
    assert out == tmp_path / "SERVE--a-BENCH--users-4" / "plugin_metrics-run=0.json"
    assert json.loads(out.read_text()) == {
        "process_start_time_seconds": 12.0, 'vllm_dspark_step_time_scale{engine="0",policy="dspark"}': 1.25}
