"""benchmarks/acceptance.py end to end on the tiny target: outputs, traces, resume, worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tiny_models import make_drafter

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "acceptance.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_acceptance_benchmark_dry_run_and_resume(tiny_target: Path, tmp_path: Path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for i, name in enumerate(("gsm8k", "humaneval", "mt-bench")):
        turns = [[10 + i, 20, 30]] + ([[40, 41]] if name == "mt-bench" else [])
        (eval_dir / f"{name}.jsonl").write_text(json.dumps({"turns": turns}) + "\n")
    drafters = [make_drafter(tiny_target, tmp_path / n, markov_rank=r) for n, r in (("a", 16), ("b", 0))]
    out = tmp_path / "results"
    args = ["--drafter", f"a={drafters[0]}", "--drafter", f"b={drafters[1]}", "--target", str(tiny_target),
            "--eval-dir", str(eval_dir), "--num-prompts", "1", "--max-new-tokens", "6", "--out-dir", str(out)]
    first = run_benchmark([*args, "--jobs", "2"])
    summary = json.loads((out / "acceptance.json").read_text())
    assert set(summary["macro_tau"]) == {"a", "b"} and set(summary["ratio"]) == {"0.0", "1.0"}
    assert summary["ratio_of"] == "a / b"
    assert len(list((out / "acceptance_cells").glob("*.json"))) == 12
    traces = sorted((out / "traces").glob("acceptance_*.jsonl"))
    assert len(traces) == 12 and all(json.loads(t.read_text().splitlines()[0])["confidences"] for t in traces)
    assert (out / "acceptance_by_position.png").stat().st_size > 0
    assert "| a/b |" in (out / "acceptance.md").read_text()
    assert "stored" not in first
    second = run_benchmark(args)
    assert second.count("stored") == 12
    # Cells evaluated one after another give what two worker processes gave.
    for cell in (out / "acceptance_cells").glob("*.json"):
        cell.unlink()
    run_benchmark(args)
    assert json.loads((out / "acceptance.json").read_text())["macro_tau"] == summary["macro_tau"]
