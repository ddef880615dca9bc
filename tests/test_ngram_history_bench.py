"""benchmarks/ngram_history.py on a small synthetic corpus: the replay's bookkeeping and report."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np

from tests.benchmark_scripts import load_benchmark


def corpus(path: Path) -> Path:
    """Code records of two kinds: ones whose response copies a 40-token prompt block, and
    ones whose response is fresh tokens that only repeat short pairs from the prompt."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        block = rng.integers(100, 200, size=40).tolist()
        if i % 2:
            response = block * 2
        else:
            response = [int(t) for t in rng.integers(100, 200, size=80)]
            response[::10] = block[:8]  # a few short matches that soon break
        lines.append(json.dumps({"id": f"r{i}", "domain": "code", "prompt_token_ids": block,
                                 "response_token_ids": response}))
    lines.append(json.dumps({"id": "other", "domain": "chat", "prompt_token_ids": [1, 2], "response_token_ids": [3]}))
    path.write_bytes(lzma.compress("\n".join(lines).encode()))
    return path


def test_the_replay_scores_both_forms_on_the_same_steps(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("ngram_history")
    monkeypatch.setattr(bench, "CORPUS", corpus(tmp_path / "corpus.jsonl.xz"))
    assert len(bench.records("code", 100)) == 24 and len(bench.records("chat", 100)) == 1
    row = bench.replay("code", 24, k=7)
    assert row["records"] == 24 and row["scored_steps"] > 0 and row["judged_drafts"] >= row["scored_steps"]
    # Copying requests and guessing ones mixed: the history tells them apart (their match
    # lengths already do much of that here, so the verified drafts at a high price agree).
    assert row["log_loss"]["history"] < row["log_loss"]["pooled"]
    assert row["net_value"]["history"]["0.75"] >= row["net_value"]["pooled"]["0.75"]
    bench.write_report({"code": row}, {"k": 7, "records": 24, "date": "now"}, tmp_path / "report")
    report = (tmp_path / "report.md").read_text()
    assert f"| code | {row['scored_steps']} | history |" in report and "net value at price 0.75" in report
    assert json.loads((tmp_path / "report.json").read_text())["domains"]["code"] == row
