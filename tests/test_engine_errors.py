"""Bad serving inputs fail at engine start-up with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tiny_models import make_drafter, make_llm


@pytest.fixture(scope="module")
def drafter(tiny_target: Path, tmp_path_factory) -> Path:
    return make_drafter(tiny_target, tmp_path_factory.mktemp("drafter"), block_size=4)


def edited_copy(drafter: Path, tmp_path: Path, **changes) -> Path:
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def start(target: Path, drafter: Path, k: int = 4, options: dict | None = None) -> None:
    make_llm(target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": k}, {"vllm_dspark": options or {"policy": "fixed"}})


def test_unknown_policy(tiny_target, drafter):
    with pytest.raises(Exception, match="policy"):
        start(tiny_target, drafter, options={"policy": "greedy-ish"})


def test_missing_sps_table_for_dspark(tiny_target, drafter):
    with pytest.raises(Exception, match="needs the engine throughput curve"):
        start(tiny_target, drafter, options={"policy": "dspark"})


def test_malformed_sps_table(tiny_target, drafter):
    with pytest.raises(Exception, match="strictly increasing"):
        start(tiny_target, drafter, options={"policy": "dspark", "sps_table": [[8, 5.0], [4, 6.0]]})


def test_missing_sps_profile(tiny_target, drafter, tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        start(tiny_target, drafter, options={"policy": "dspark", "sps_profile": str(tmp_path / "none.json")})


def test_k_larger_than_block_size(tiny_target, drafter):
    with pytest.raises(Exception, match="larger than the drafter's block_size"):
        start(tiny_target, drafter, k=6)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"vocab_size": 1024}, "vocabulary is 1024, target vocabulary is 512"),
        ({"hidden_size": 256, "target_hidden_size": 256}, "target hidden size 256"),
        ({"target_layer_ids": [1, 7]}, "out of range"),
    ],
)
def test_drafter_mismatch(tiny_target, drafter, tmp_path, changes, message):
    with pytest.raises(Exception, match=message):
        start(tiny_target, edited_copy(drafter, tmp_path, **changes))
