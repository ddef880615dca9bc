"""The plugin's GPU path calls the fused sequential-head kernel behind the capability check.

No GPU in CI: the capability check is forced on and the kernel entry point runs its
PyTorch reference on CPU tensors, which shows the wiring and the argument mapping.
"""

from __future__ import annotations

import torch

from tests.tiny_models import make_drafter, make_llm
from vllm_dspark.integration import proposer as proposer_module
from vllm_dspark.kernels import dispatch
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.heads import sequential_draft


def test_fused_path_matches_pytorch_loop(tiny_target, tmp_path, monkeypatch):
    drafter = DSparkDrafter.from_pretrained(make_drafter(tiny_target, tmp_path / "d", block_size=6), tiny_target)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
        drafter.confidence_head.proj.weight.mul_(40)

    class VllmLike:  # what the proposer reads from the vLLM draft model
        markov_head = drafter.markov_head
        confidence_head = drafter.confidence_head
        # A block of 6 served with K = 4: the proposer must hand the kernel K temperatures.
        confidence_temperatures = torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1, 0.9])
        draft_ids = None  # full vocabulary

    force_kernel_path_on_cpu(monkeypatch)
    assert proposer_module.fused_head_applies(VllmLike)
    hidden = torch.randn(3, 4, 128)
    base = drafter.lm_head(hidden)
    anchors = torch.tensor([5, 77, 300])
    heads = (VllmLike.markov_head, VllmLike.confidence_head, VllmLike.confidence_temperatures)
    for temperature in (None, torch.tensor([1.0, 0.0, 0.7])):
        # Both paths draw their sampler seeds from torch's default generator.
        torch.manual_seed(0)
        fused = proposer_module.fused_sequential_draft(VllmLike, base, hidden, anchors, temperature)
        torch.manual_seed(0)
        loop = sequential_draft(*heads, base, hidden, anchors, temperature)
        assert torch.equal(fused.tokens, loop.tokens)
        torch.testing.assert_close(fused.confidences, loop.confidences, atol=1e-5, rtol=1e-5)
        assert (fused.probs is None) == (loop.probs is None) == (temperature is None)
        if temperature is not None:
            assert fused.probs.shape == (3, 4, 512)
            torch.testing.assert_close(fused.probs, loop.probs, atol=1e-6, rtol=1e-5)


def force_kernel_path_on_cpu(monkeypatch) -> list[int]:
    """Capability check on; the kernel entry point runs its reference. Returns a call log."""
    calls: list[int] = []
    entry = dispatch.sequential_head

    def spy(*args, **kwargs):
        calls.append(1)
        return entry(*args, use_kernel=False, **kwargs)

    monkeypatch.setattr(dispatch, "triton_kernels_enabled", lambda: True)
    monkeypatch.setattr(dispatch, "sequential_head", spy)
    return calls


def test_engine_uses_fused_head_when_enabled(tiny_target, tmp_path, monkeypatch):
    checks = dispatch.triton_kernels_enabled
    calls = force_kernel_path_on_cpu(monkeypatch)
    drafter = make_drafter(tiny_target, tmp_path / "d", block_size=4)
    from tests.tiny_models import generate_ids

    llm = make_llm(tiny_target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": 4})
    assert len(generate_ids(llm, [[5, 6, 7]], 8)[0]) == 8
    assert calls, "the proposer should call the fused head when kernels are enabled"
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not checks(), "the switch forces the PyTorch reference"


def test_admission_never_creates_a_cuda_context(monkeypatch):
    """A scheduler-only process (multiprocess executor) keeps admission in NumPy even when
    kernels are enabled: a CUDA context there would cost GPU memory for nothing."""
    from vllm_dspark.integration.scheduler import admission_device

    monkeypatch.setattr(dispatch, "triton_kernels_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert admission_device() is None
    monkeypatch.setattr(dispatch, "triton_kernels_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert admission_device() is None
