"""Triton kernels against their PyTorch references, on CPU through the Triton interpreter.

The sequential head's reference is the model's own `heads.sequential_draft` (reached
through the dispatcher's reference path, which wraps the kernel's weights in the vanilla
heads).

The interpreter has to be switched on before `triton` is first imported, so this module
imports `vllm_dspark.kernels.interpret` before anything that could pull triton in. If some
earlier test module already imported triton, the kernel tests rerun this file in a fresh
process instead. References run in float64; kernel outputs are poisoned before each
launch so an element the kernel forgets to write fails the comparison.
"""

import re
import subprocess
import sys
from pathlib import Path

import vllm_dspark.kernels.interpret as interpret  # noqa: I001  (must precede triton)

import numpy as np
import pytest
import torch

IN_INTERPRETER = interpret.interpreter_ready()
if IN_INTERPRETER:
    interpret.load_interpreted_kernels()

from vllm_dspark.kernels import admission, dispatch, sequential_head, verify_attention  # noqa: E402
from vllm_dspark.model.heads import DraftOutput, sequential_draft, vanilla_heads  # noqa: E402

needs_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason="triton imported before interpreter mode")

POISON_F = float("nan")
POISON_I = -7777


@pytest.mark.skipif(IN_INTERPRETER, reason="kernels run in this process")
def test_kernels_in_fresh_process() -> None:
    """Triton was imported without the interpreter by an earlier module: rerun here, isolated."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The child must really have run the interpreter tests: only this test may skip there.
    summary = proc.stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped)", summary)}
    assert counts.get("skipped", 0) == 1, summary
    assert counts.get("passed", 0) >= len(re.findall(r"^def test_", Path(__file__).read_text(), re.M)) - 1, summary


# ---------------------------------------------------------------------------- attention


def _paged_case(lens, ctxs, num_kv_heads, group, head_dim, block_size, dtype, parents=None, seed=0):
    """Random paged-cache inputs; blocks are scattered through a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    num_req = len(lens)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    nblk = [(c + block_size - 1) // block_size for c in ctxs]
    pool = sum(nblk) + 2
    perm = torch.randperm(pool, generator=g).to(torch.int32)
    table = torch.full((num_req, max(max(nblk, default=0), 1) + 1), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[used:used + n]
        used += n

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    heads = num_kv_heads * group
    tree = None if parents is None else torch.tensor(parents, dtype=torch.int32)
    return dict(
        q=rnd(total, heads, head_dim), k_new=rnd(total, num_kv_heads, head_dim),
        v_new=rnd(total, num_kv_heads, head_dim),
        key_cache=rnd(pool, block_size, num_kv_heads, head_dim),
        value_cache=rnd(pool, block_size, num_kv_heads, head_dim),
        block_table=table, context_lens=torch.tensor(ctxs, dtype=torch.int32), cu_seqlens_q=cu,
        tree_parents=tree,
    )


def _random_tree(n: int, gen: torch.Generator) -> list:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}

TREE_GEN = torch.Generator().manual_seed(1)
ATTENTION_CASES = {
    # name: (lens, ctxs, num_kv_heads, group, head_dim, block_size, dtype, parents, block_n)
    "chain_mixed_fp32_gqa1": ([3, 0, 1, 8], [5, 7, 0, 33], 2, 1, 64, 16, torch.float32, None, 16),
    "chain_fp16_gqa3_d80_odd_blocks": ([8, 2, 5], [19, 1, 40], 2, 3, 80, 5, torch.float16, None, 16),
    "chain_bf16_gqa8_d128": ([8, 1], [21, 3], 1, 8, 128, 16, torch.bfloat16, None, 16),
    "chain_fp16_d256_empty_ctx": ([6, 4], [0, 9], 1, 1, 256, 8, torch.float16, None, 32),
    "chain_fp32_d96_multi_qtiles": ([20, 3], [4, 0], 1, 8, 96, 16, torch.float32, None, 16),
    "tree_one_branch_fp32": ([5, 8], [6, 11], 1, 3, 64, 16, torch.float32, [-1, 0, 1, 2, 3] + list(range(-1, 7)), 16),
    "tree_many_branches_bf16": ([9, 0, 12], [10, 3, 25], 2, 3, 64, 16, torch.bfloat16,
                                _random_tree(9, TREE_GEN) + _random_tree(12, TREE_GEN), 16),
    "tree_star_and_forest_fp16": ([7, 6], [5, 0], 1, 8, 80, 16, torch.float16,
                                  [-1, 0, 0, 0, 0, 0, 0] + [-1, 0, -1, 2, 2, -1], 16),
    "tree_deep_multi_qtiles_fp32": ([24], [13], 1, 3, 64, 4, torch.float32,
                                    list(range(-1, 11)) + _random_tree(12, TREE_GEN)[1:] + [5], 16),
}


@needs_interpreter
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_verify_attention_matches_reference(name: str) -> None:
    lens, ctxs, hkv, group, d, bs, dtype, parents, block_n = ATTENTION_CASES[name]
    case = _paged_case(lens, ctxs, hkv, group, d, bs, dtype, parents)
    ref = verify_attention.verify_attention_reference(**case, compute_dtype=torch.float64)
    out = torch.full_like(case["q"], POISON_F)
    got = verify_attention.verify_attention_triton(**case, block_n=block_n, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("seed", range(4))
def test_verify_attention_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    num_req = pick([1, 2, 3, 5])
    lens = [pick([0, 1, 2, 5, 8, 9]) for _ in range(num_req)]
    ctxs = [pick([0, 1, 7, 16, 37]) for _ in range(num_req)]
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    parents = None
    if pick([False, True]):
        parents = sum((_random_tree(n, g) for n in lens if n), [])
    case = _paged_case(lens, ctxs, pick([1, 2]), pick([1, 3, 8]), pick([64, 80, 96, 128, 256]),
                       pick([1, 5, 16]), dtype, parents, seed)
    ref = verify_attention.verify_attention_reference(**case, compute_dtype=torch.float64)
    got = verify_attention.verify_attention_triton(**case, block_n=pick([16, 32]),
                                                   out=torch.full_like(case["q"], POISON_F))
    torch.testing.assert_close(got.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_interpreter
def test_tree_with_chain_parents_equals_chain() -> None:
    lens = [4, 7]
    parents = [-1, 0, 1, 2] + [-1, 0, 1, 2, 3, 4, 5]
    case = _paged_case(lens, [9, 2], 1, 3, 64, 16, torch.float32, parents)
    tree = verify_attention.verify_attention_triton(**case)
    chain = verify_attention.verify_attention_triton(**{**case, "tree_parents": None})
    torch.testing.assert_close(tree, chain, atol=1e-6, rtol=1e-6)


@needs_interpreter
def test_verify_attention_reads_flash_attention_cache_layout() -> None:
    """vLLM's FlashAttention cache [blocks, kv_heads, block_size, 2 * D] viewed as strided
    K and V caches, as the attention backend passes them."""
    case = _paged_case([5, 1, 8], [9, 30, 0], 2, 3, 64, 16, torch.float32)
    pool = case["key_cache"].shape[0]
    kv = torch.randn(pool, 2, 16, 128, generator=torch.Generator().manual_seed(3))
    case["key_cache"], case["value_cache"] = kv.transpose(1, 2).split(64, dim=-1)
    assert not case["key_cache"].is_contiguous()
    ref = verify_attention.verify_attention_reference(**case, compute_dtype=torch.float64)
    got = verify_attention.verify_attention_triton(**case, out=torch.full_like(case["q"], POISON_F))
    torch.testing.assert_close(got.double(), ref.double(), atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_reference_matches_sdpa_on_chain() -> None:
    """The reference itself, against torch SDPA on one unpaged request."""
    case = _paged_case([5], [11], 2, 3, 64, 4, torch.float64)
    ref = verify_attention.verify_attention_reference(**case, compute_dtype=torch.float64)
    pos = torch.arange(11)
    blocks = case["block_table"][0, pos // 4].long()
    keys = torch.cat([case["key_cache"][blocks, pos % 4], case["k_new"]])
    vals = torch.cat([case["value_cache"][blocks, pos % 4], case["v_new"]])
    mask = torch.ones(5, 16, dtype=torch.bool).tril(diagonal=11)
    q = case["q"].transpose(0, 1)  # [H, n, D]
    k = keys.repeat_interleave(3, dim=1).transpose(0, 1)
    v = vals.repeat_interleave(3, dim=1).transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ref, sdpa.transpose(0, 1))


@needs_interpreter
def test_verify_attention_all_requests_empty() -> None:
    case = _paged_case([0, 0], [3, 0], 1, 1, 64, 16, torch.float32)
    assert verify_attention.verify_attention_triton(**case).shape == (0, 1, 64)


# ---------------------------------------------------------------------------- sequential head


def _head_case(num_req, k, vocab, rank, hid, dtype, conf="markov", seed=0):
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 1.0, 0.6, 1.7] * num_req)[:num_req]
    conf_len = {"markov": hid + rank, "plain": hid, None: None}[conf]
    return dict(
        base_logits=(torch.randn(num_req, k, vocab, generator=g) * 2).to(dtype),
        anchor=torch.randint(0, vocab, (num_req,), generator=g),
        w1=(torch.randn(vocab, rank, generator=g) * 0.3).to(dtype),
        w2=(torch.randn(vocab, rank, generator=g) * 0.3).to(dtype),
        temperature=temps,
        seeds=torch.randint(-2**62, 2**62, (num_req,), generator=g),
        hidden=torch.randn(num_req, k, hid, generator=g).to(dtype),
        conf_weight=None if conf is None else (torch.randn(conf_len, generator=g) * 0.2).to(dtype),
        conf_bias=0.3,
        conf_temps=None if conf is None else torch.linspace(0.7, 1.6, k),
    )


HEAD_CASES = {
    # name: (R, K, V, r, d, dtype, confidence head, return_probs, vocabulary splits)
    "fp32_markov_conf_probs_masked_tails": (5, 3, 300, 24, 40, torch.float32, "markov", True, 1),
    "fp32_splits_probs": (5, 3, 700, 24, 40, torch.float32, "markov", True, 3),
    "fp32_two_row_tiles": (19, 2, 200, 16, 16, torch.float32, "plain", False, 2),
    "bf16_no_conf_many_splits": (4, 4, 1000, 64, 32, torch.bfloat16, None, False, 5),
    "fp16_one_step_probs": (3, 1, 129, 32, 300, torch.float16, "markov", True, 2),
}


def _model_reference(case: dict, return_probs: bool) -> DraftOutput:
    """The model's sequential_draft on the case's weights, in float64."""
    wide = {n: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for n, v in case.items()}
    return dispatch.sequential_head(**wide, return_probs=return_probs, use_kernel=False)


@needs_interpreter
@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_sequential_head_matches_model(name: str) -> None:
    num_req, k, vocab, rank, hid, dtype, conf, probs, splits = HEAD_CASES[name]
    case = _head_case(num_req, k, vocab, rank, hid, dtype, conf)
    ref = _model_reference(case, probs)
    out = DraftOutput(
        tokens=torch.full((num_req, k), POISON_I, dtype=torch.int64),
        token_probs=torch.full((num_req, k), POISON_F),
        confidences=torch.full((num_req, k), POISON_F),
        probs=torch.full((num_req, k, vocab), POISON_F) if probs else None,
    )
    got = sequential_head.sequential_head_triton(**case, return_probs=probs, num_splits=splits, out=out)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.token_probs, ref.token_probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.confidences, ref.confidences, atol=1e-5, rtol=1e-4)
    greedy = case["temperature"] == 0
    assert torch.equal(got.token_probs[greedy], torch.ones(int(greedy.sum()), k))
    if probs:
        torch.testing.assert_close(got.probs, ref.probs, atol=1e-6, rtol=1e-4)
        assert torch.allclose(ref.probs.sum(-1), torch.ones(num_req, k))
        assert torch.equal(ref.probs.gather(2, ref.tokens[..., None])[..., 0], ref.token_probs)


@needs_interpreter
@pytest.mark.parametrize("probs", [False, True])
def test_sequential_head_with_a_reduced_vocabulary_matches_model(probs: bool) -> None:
    """Draft ids 0..63 stand for 64 of 300 target ids: the kernel picks over the draft ids,
    feeds W1 and returns the target ids, and its rows (zero outside the subset) equal the
    reference's, over two vocabulary splits."""
    num_req, k, target_vocab, draft_vocab, rank, hid = 6, 3, 300, 64, 24, 40
    case = _head_case(num_req, k, draft_vocab, rank, hid, torch.float32)
    g = torch.Generator().manual_seed(1)
    case["w1"] = torch.randn(target_vocab, rank, generator=g) * 0.3
    case["anchor"] = torch.randint(0, target_vocab, (num_req,), generator=g)
    d2t = torch.randperm(target_vocab, generator=g)[:draft_vocab].sort().values
    ref = _model_reference(case | {"draft_to_target": d2t}, probs)
    got = sequential_head.sequential_head_triton(**case, return_probs=probs, num_splits=2, draft_to_target=d2t)
    assert torch.equal(got.tokens, ref.tokens) and bool(torch.isin(got.tokens, d2t).all())
    torch.testing.assert_close(got.token_probs, ref.token_probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.confidences, ref.confidences, atol=1e-5, rtol=1e-4)
    if probs:
        assert got.probs.shape == (num_req, k, target_vocab)
        torch.testing.assert_close(got.probs, ref.probs, atol=1e-6, rtol=1e-4)


def test_reduced_vocabulary_shapes_are_checked() -> None:
    case = _head_case(2, 2, 64, 8, 8, torch.float32, None)
    with pytest.raises(ValueError, match="draft_to_target"):
        dispatch.sequential_head(**case, draft_to_target=torch.arange(63), use_kernel=False)
    with pytest.raises(ValueError, match="w1/w2"):
        dispatch.sequential_head(**case | {"w1": torch.zeros(300, 8)}, use_kernel=False)


def test_sampling_follows_softmax_and_ignores_batch_position() -> None:
    """Gumbel-max over the hash RNG draws from softmax(logits / T); a seed fixes the draw."""
    num_req, vocab, rank = 20000, 5, 4
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    args = dict(
        base_logits=logits.expand(num_req, 1, vocab).contiguous(),
        anchor=torch.zeros(num_req, dtype=torch.int64),
        w1=torch.zeros(vocab, rank), w2=torch.zeros(vocab, rank),
        temperature=torch.full((num_req,), 0.8), seeds=torch.arange(num_req) * 7919 + 3,
        use_kernel=False,
    )
    out = dispatch.sequential_head(**args)
    freq = torch.bincount(out.tokens[:, 0], minlength=vocab).double() / num_req
    torch.testing.assert_close(freq, torch.softmax(logits.double() / 0.8, 0), atol=0.012, rtol=0)
    flipped = dispatch.sequential_head(**{**args, "seeds": args["seeds"].flip(0)})
    assert torch.equal(flipped.tokens.flip(0), out.tokens)


def test_greedy_rows_are_point_masses_at_the_argmax() -> None:
    """A greedy row's token is not drawn from the softmax: its draft row is one-hot, the
    token's probability 1, and no seed changes it."""
    case = _head_case(3, 2, 50, 8, 8, torch.float64, None)
    case["temperature"] = torch.zeros(3)
    out = _model_reference(case, return_probs=True)
    assert torch.equal(out.probs, torch.nn.functional.one_hot(out.tokens, 50).float())
    assert torch.equal(out.token_probs, torch.ones(3, 2))
    reseeded = _model_reference({**case, "seeds": case["seeds"] + 1}, return_probs=True)
    assert torch.equal(reseeded.tokens, out.tokens)


# ---------------------------------------------------------------------------- admission


def _numpy_policy():
    try:
        from vllm_dspark.scheduling import select_verify_lengths
    except ImportError:
        return None
    return lambda c, b: select_verify_lengths(c.numpy(), lambda n: np.ones_like(n, dtype=np.float64),
                                              "dspark_async", budget=b)


ADMISSION_CASES = {
    # name: (R, K, quantised values or None for continuous, budgets)
    "continuous": (13, 7, None, [0, 1, 5, 40, 91, 200]),
    "ties_and_zeros": (9, 5, [0.0, 0.5, 1.0], [0, 3, 17, 45, 100]),
    "one_slot": (1, 1, None, [0, 1, 2]),
    "many_requests_masked_tail": (70, 3, [0.25, 0.5, 0.75, 1.0], [1, 99, 210, 300]),
}


@needs_interpreter
@pytest.mark.parametrize("name", list(ADMISSION_CASES))
def test_admission_matches_reference_and_policy(name: str) -> None:
    num_req, k, levels, budgets = ADMISSION_CASES[name]
    g = torch.Generator().manual_seed(3)
    if levels is None:
        conf = torch.rand(num_req, k, generator=g)
    else:
        conf = torch.tensor(levels)[torch.randint(0, len(levels), (num_req, k), generator=g)]
    policy = _numpy_policy()
    for budget in budgets:
        ref = admission.admission_lengths_reference(conf, budget)
        out = torch.full((num_req,), POISON_I, dtype=torch.int64)
        got = admission.admission_lengths_triton(conf, budget, out=out)
        assert torch.equal(got, ref), (budget, got, ref)
        assert int(ref.sum()) <= budget
        if policy is not None:
            assert np.array_equal(policy(conf, budget), ref.numpy()), budget


def test_admission_reference_tie_order() -> None:
    """Equal survival: smaller j first, then smaller r; zero survival is never admitted."""
    conf = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.5, 1.0], [1.0, 1.0, 1.0]])
    # a = [[1,1,0],[1,.5,.5],[1,1,1]]: order (0,0)(1,0)(2,0)(0,1)(2,1)(2,2)(1,1)(1,2)
    expected = {1: [1, 0, 0], 3: [1, 1, 1], 4: [2, 1, 1], 5: [2, 1, 2], 7: [2, 2, 3], 9: [2, 3, 3]}
    for budget, lengths in expected.items():
        assert admission.admission_lengths_reference(conf, budget).tolist() == lengths


# ---------------------------------------------------------------------------- dispatch


def test_capability_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not dispatch.triton_kernels_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dispatch.triton_kernels_enabled()
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.triton_kernels_enabled()


@pytest.mark.parametrize("reason", ["forced", "no_cuda"])
def test_wrappers_use_reference(monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    if reason == "forced":
        monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    else:
        monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def boom(*args, **kwargs):
        raise AssertionError("kernel path taken")

    for name in ("verify_attention_triton", "sequential_head_triton", "admission_lengths_triton"):
        monkeypatch.setattr(dispatch, name, boom)
    case = _paged_case([2, 3], [4, 0], 1, 2, 64, 16, torch.float32)
    torch.testing.assert_close(dispatch.verify_attention(**case),
                               verify_attention.verify_attention_reference(**case))
    head = _head_case(2, 2, 40, 8, 8, torch.float32)
    heads = vanilla_heads(head["w1"], head["w2"], 8, head["conf_weight"], head["conf_bias"])
    model = sequential_draft(*heads, head["conf_temps"], head["base_logits"], head["hidden"], head["anchor"],
                             head["temperature"], head["seeds"])
    got = dispatch.sequential_head(**head)
    assert torch.equal(got.tokens, model.tokens) and torch.equal(got.confidences, model.confidences)
    conf = torch.rand(3, 4)
    assert torch.equal(dispatch.admission_lengths(conf, 5), admission.admission_lengths_reference(conf, 5))


@needs_interpreter
def test_wrapper_forced_kernel_path_runs_kernel() -> None:
    conf = torch.rand(4, 3)
    assert torch.equal(dispatch.admission_lengths(conf, 6, use_kernel=True),
                       admission.admission_lengths_reference(conf, 6))
