"""The GPU kernel benchmark's CPU dry run: every case wired up and matching its reference."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"


def test_bench_kernels_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_kernels.dryrun.json").read_text())
    assert report["meta"]["mode"] == "dry-run"
    assert {r["kernel"] for r in report["results"]} == {"verify_attention", "sequential_head", "admission"}
    assert report["drafter_stage"] and all(r["ok"] for r in report["drafter_stage"])
    assert all(r["ok"] for r in report["results"])
    assert "Dry run" in (tmp_path / "bench_kernels.dryrun.md").read_text()
    assert not (tmp_path / "bench_kernels.json").exists()
