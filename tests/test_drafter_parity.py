"""The plain-PyTorch drafter computes what the drafter inside vLLM computes."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import engine_runner, make_drafter, make_llm
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.target_features import capture_target_states

PROMPT = [5, 6, 7, 8, 9, 10, 11, 100, 200]


def first_proposal_in_vllm(target: Path, drafter: Path, k: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Anchor, drafts and confidences of the first proposal the engine makes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": k}, {"vllm_dspark": {"policy": "fixed"}})
    runner = engine_runner(llm)
    proposer = runner.drafter
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


def test_torch_drafter_matches_vllm(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    k = 4
    drafter_dir = make_drafter(tiny_target, tmp_path / "drafter", block_size=k, markov_head_type="gated")
    sharpened = DSparkDrafter.from_pretrained(drafter_dir, tiny_target)
    with torch.no_grad():  # spread confidences over (0, 1) so they expose any mismatch
        sharpened.confidence_head.proj.weight.mul_(50.0)
    sharpened.save_pretrained(drafter_dir)
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
