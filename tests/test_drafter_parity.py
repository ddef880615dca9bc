"""The plain-PyTorch drafter computes what the drafter inside vLLM computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import engine_runner, make_drafter, make_llm
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.target_features import capture_target_states

PROMPT = [5, 6, 7, 8, 9, 10, 11, 100, 200]


def first_proposal_in_vllm(
    target: Path, drafter: Path, k: int, context_projection: str = "float32"
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Anchor, drafts and confidences of the first proposal the engine makes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    options = {"policy": "fixed", "context_projection": context_projection}
    llm = make_llm(target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": k}, {"vllm_dspark": options})
    runner = engine_runner(llm)
    proposer = runner.drafter
    assert proposer.model.fc_dtype == (torch.float32 if context_projection == "float32" else torch.bfloat16)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = proposer._sample_draft_tokens

    def spy(hidden_states, sampling_metadata):
        tokens, probs = original(hidden_states, sampling_metadata)
        confidences = proposer._confidences.clone()
        seen.append((proposer._anchors.clone(), tokens.clone(), confidences))
        return tokens, probs

    proposer._sample_draft_tokens = spy
    llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], SamplingParams(max_tokens=2, temperature=0.0, detokenize=False), use_tqdm=False)
    anchor, tokens, confidences = seen[0]
    return int(anchor[0]), tokens.view(-1), confidences.view(-1)


def sharpened_drafter(target: Path, directory: Path, k: int) -> Path:
    """A tiny drafter whose confidences spread over (0, 1), so they expose any mismatch."""
    drafter_dir = make_drafter(target, directory, block_size=k, markov_head_type="gated")
    sharpened = DSparkDrafter.from_pretrained(drafter_dir, target)
    with torch.no_grad():
        sharpened.confidence_head.proj.weight.mul_(50.0)
    sharpened.save_pretrained(drafter_dir)
    return drafter_dir


def test_torch_drafter_matches_vllm(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    k = 4
    drafter_dir = sharpened_drafter(tiny_target, tmp_path / "drafter", k)
    anchor, vllm_tokens, vllm_conf = first_proposal_in_vllm(tiny_target, drafter_dir, k)

    target = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32)
    drafter = DSparkDrafter.from_pretrained(drafter_dir, tiny_target).eval()
    context, _ = capture_target_states(target, torch.tensor([PROMPT]), drafter.config.target_layer_ids)
    with torch.no_grad():
        ids = drafter.block_input_ids(torch.tensor([[anchor]]), k)
        hidden = drafter.backbone(context, ids, torch.tensor([[len(PROMPT)]]))[0, 0, :k]
        ours = drafter.draft(hidden.unsqueeze(0), torch.tensor([anchor]))
    assert vllm_conf.max() - vllm_conf.min() > 0.05
    torch.testing.assert_close(ours.confidences.view(-1), vllm_conf, atol=2e-4, rtol=1e-3)
    assert ours.tokens.view(-1).tolist() == vllm_tokens.tolist()


def test_bfloat16_context_projection_changes_only_the_rounding(tiny_target, tmp_path):
    """With `fc` in bfloat16 the first proposal's confidences move by its rounding alone."""
    k = 4
    drafter_dir = sharpened_drafter(tiny_target, tmp_path / "drafter", k)
    anchor, _, exact = first_proposal_in_vllm(tiny_target, drafter_dir, k)
    rounded_anchor, _, rounded = first_proposal_in_vllm(tiny_target, drafter_dir, k, context_projection="bfloat16")
    assert rounded_anchor == anchor
    difference = (rounded - exact).abs().max().item()
    assert 0.0 < difference < 0.05


@pytest.mark.parametrize("native", [True, False])
def test_auto_context_projection_takes_bfloat16_only_where_it_is_cheaper(monkeypatch, native):
    from vllm_dspark.integration import draft_model

    monkeypatch.setattr(draft_model, "native_bfloat16_matmul", lambda: native)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    expected = torch.bfloat16 if native else torch.float32
    assert draft_model.context_projection_dtype("auto", torch.float32, cpu) == expected
    assert draft_model.context_projection_dtype("auto", torch.float32, gpu) == torch.float32
    assert draft_model.context_projection_dtype("auto", torch.float16, cpu) == torch.float16
    assert draft_model.context_projection_dtype("float32", torch.float32, cpu) == torch.float32
    assert draft_model.context_projection_dtype("bfloat16", torch.float32, gpu) == torch.bfloat16
