"""The committed SmolLM2 drafters load and serve through the plugin, losslessly, with
drafts actually accepted (they are trained, unlike the drafters of the other tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import engine_scheduler, make_llm, spec_counters
from vllm_dspark.model.drafter import DSparkDrafter

DRAFTERS = Path(__file__).resolve().parents[1] / "examples" / "drafters"
COMMITTED = ["smollm2-dspark-b7", "smollm2-dflash-b7"]
PROMPTS = [
    [{"role": "user", "content": "What is 15 plus 27? Answer with the number."}],
    [{"role": "user", "content": "Write a Python function that returns the square of x."}],
]
SPS_TABLE = [[1, 11.9], [2, 11.0], [4, 10.4], [8, 8.9], [16, 6.8], [32, 5.5], [64, 3.2], [128, 2.1]]


def chat_ids(llm, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.chat(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(smollm2_target) -> list[list[int]]:
    """Plain decoding's greedy answers, computed once for both drafters."""
    from vllm import SamplingParams

    return chat_ids(make_llm(smollm2_target), SamplingParams(max_tokens=24, temperature=0.0))


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_drafter_serves_losslessly(name, smollm2_target, plain):
    from vllm import SamplingParams

    drafter = DRAFTERS / name
    DSparkDrafter.from_pretrained(drafter, smollm2_target)  # fits the target, weights complete
    spec = {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": 7}
    llm = make_llm(smollm2_target, spec, {"vllm_dspark": {"policy": "dspark", "sps_table": SPS_TABLE}})
    assert chat_ids(llm, SamplingParams(max_tokens=24, temperature=0.0)) == plain
    assert spec_counters(llm)["num_accepted_tokens"] > 0
    assert engine_scheduler(llm).controller.stats.accepted > 0
