"""Offline evaluator: lossless rejection sampling, exact greedy verification, the JSON and
trace it writes, and clear errors for bad inputs."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_dspark.evaluation import cli as eval_cli
from vllm_dspark.evaluation.evaluator import EvalSettings, SpeculativeDecoder, evaluate
from vllm_dspark.evaluation.target_runner import IncrementalTarget
from vllm_dspark.evaluation.verification import greedy_verify, rejection_sample
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.target_features import capture_target_states

from tests.tiny_models import fit_markov_to_transitions, make_drafter

PROMPTS = [[5, 17, 300, 42, 8], [100, 7, 250], [64, 65, 66, 67, 68, 69]]
GREEDY_STEPS = 40


@pytest.fixture(autouse=True)
def _one_thread():
    """Two threads on a busy 2-core machine spin on each other (10-50x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def drafter_dir(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_drafter(tiny_target, tmp_path_factory.mktemp("drafter"))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    eval_cli.register_cli(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


# ------------------------------------------------------------- rejection sampling
def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    assert expected.min() >= 5, "too few trials for a chi-square test"
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def chain_outputs(trials: int, lossless: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Three output tokens per trial from a 2-draft chain (V = 5) and their exact target law.

    Target: y1 ~ p1, y2 ~ P2[y1], y3 ~ P3[y2]; draft: x1 ~ q1, x2 ~ Q2[x1], both far from the
    target and with supports that differ (q1 has a zero the target does not, and vice versa).
    Tokens a round does not produce come from the target directly, as the next round would.
    """
    gen = torch.Generator().manual_seed(1234)
    v = 5
    dirichlet = torch.distributions.Dirichlet(torch.full((v,), 3.0))
    torch.manual_seed(99)
    p1, big_p2, big_p3 = dirichlet.sample(), dirichlet.sample((v,)), dirichlet.sample((v,))
    q1, big_q2 = dirichlet.sample().pow(3), dirichlet.sample((v,)).pow(3)
    p1[4], q1[0] = 0.0, 0.0
    p1, q1 = p1 / p1.sum(), q1 / q1.sum()
    big_q2 = big_q2 / big_q2.sum(-1, keepdim=True)

    def sample(rows: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(rows, 1, generator=gen).squeeze(1)

    x1 = sample(q1.expand(trials, v))
    x2 = sample(big_q2[x1])
    drafts = torch.stack([x1, x2], 1)
    if lossless:
        draft_probs = torch.stack([q1.expand(trials, v), big_q2[x1]], 1)
        target_probs = torch.stack([p1.expand(trials, v), big_p2[x1], big_p3[x2]], 1)
        accepted, nxt = rejection_sample(drafts, draft_probs, target_probs, gen)
    else:  # the control: drafts taken as they are
        accepted, nxt = torch.full((trials,), 2), sample(big_p3[x2])
    y1 = torch.where(accepted == 0, nxt, x1)
    y2 = torch.where(accepted == 1, nxt, torch.where(accepted == 2, x2, sample(big_p2[y1])))
    y3 = torch.where(accepted == 2, nxt, sample(big_p3[y2]))
    counts = torch.bincount(y1 * v * v + y2 * v + y3, minlength=v**3).double()
    law = (p1[:, None, None] * big_p2[:, :, None] * big_p3[None, :, :]).reshape(-1).double()
    support = law > 0
    assert counts[~support].sum() == 0 or not lossless, "a token the target never emits came out"
    return counts[support], law[support]


def test_rejection_sampling_is_lossless():
    counts, law = chain_outputs(200_000, lossless=True)
    assert chi_square_p_value(counts, law) > 1e-3


def test_chi_square_detects_a_lossy_sampler():
    """The same test rejects plain acceptance of the drafts, so the one above has power."""
    counts, law = chain_outputs(200_000, lossless=False)
    assert chi_square_p_value(counts, law) < 1e-9


def test_rejection_sample_accepts_identical_distributions_and_rejects_zero_target():
    probs = torch.tensor([[0.2, 0.3, 0.5]]).expand(2, 3)
    drafts = torch.tensor([[2, 1], [0, 0]])
    draft_probs = torch.stack([probs, probs], 1)
    target_probs = torch.stack([probs, probs, probs], 1).clone()
    accepted, _ = rejection_sample(drafts, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 2]
    target_probs[1, 0] = torch.tensor([0.0, 1.0, 0.0])  # target never emits token 0 first
    accepted, nxt = rejection_sample(drafts, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 0] and nxt[1] == 1


def test_greedy_verify_by_hand():
    logits = torch.full((3, 4, 6), -1.0)
    best = torch.tensor([[3, 1, 4, 5], [3, 1, 4, 5], [3, 1, 4, 5]])
    logits.scatter_(2, best.unsqueeze(-1), 1.0)
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    accepted, nxt = greedy_verify(drafts, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [5, 1, 3]


# ------------------------------------------------------------------ the decoder
def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Plain argmax decoding, full forward each step, no cache."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def untied_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with its own random LM head: tied to its large embeddings, the
    random model only repeats the last token, which would leave greedy checks toothless."""
    from transformers import LlamaForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)
    config = tied.config
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    model.load_state_dict({k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}, strict=False)
    out = tmp_path_factory.mktemp("untied_target")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def greedy_case(untied_target: Path, tmp_path_factory: pytest.TempPathFactory):
    """The target, its greedy continuations of PROMPTS, and a drafter whose Markov head
    knows part of the target's transitions (so acceptance is partial)."""
    model = AutoModelForCausalLM.from_pretrained(str(untied_target), dtype=torch.float32).eval()
    references = [greedy_reference(model, p, GREEDY_STEPS) for p in PROMPTS]
    drafter_dir = make_drafter(untied_target, tmp_path_factory.mktemp("fitted"))
    fit_markov_to_transitions(drafter_dir, untied_target, [r[: GREEDY_STEPS // 2] for r in references])
    return model, references, DSparkDrafter.from_pretrained(drafter_dir, untied_target)


def test_greedy_speculation_reproduces_the_target(greedy_case):
    model, references, drafter = greedy_case
    target = IncrementalTarget(model, drafter.config.target_layer_ids)
    decoder = SpeculativeDecoder(target, drafter, num_draft=4, temperature=0.0, stop_ids=set())
    accepted: list[int] = []
    for prompt, reference in zip(PROMPTS, references):
        result = decoder.generate(prompt, GREEDY_STEPS, torch.Generator())
        assert result.tokens == reference
        accepted += result.accepted
        # The incrementally captured states (with crops) equal a full recomputation.
        seen = prompt + result.tokens[:-1]
        full, _ = capture_target_states(model, torch.tensor([seen]), drafter.config.target_layer_ids)
        torch.testing.assert_close(target.context[:, : len(seen)], full, atol=1e-4, rtol=1e-4)
    target.close()
    # Both paths exercised: long accepted runs and rejections inside the block.
    assert max(accepted) >= 3 and min(accepted) <= 1, accepted


def test_output_is_cut_at_eos_and_budget(greedy_case):
    model, references, drafter = greedy_case
    target = IncrementalTarget(model, drafter.config.target_layer_ids)
    reference = references[2]
    stop = reference[30]
    decoder = SpeculativeDecoder(target, drafter, num_draft=4, temperature=0.0, stop_ids={stop})
    assert decoder.generate(PROMPTS[2], GREEDY_STEPS, torch.Generator()).tokens == reference[: reference.index(stop) + 1]
    decoder.stop_ids = set()
    assert decoder.generate(PROMPTS[2], 27, torch.Generator()).tokens == reference[:27]
    target.close()


# ------------------------------------------------------------------ end to end
def test_evaluate_end_to_end_json_and_trace(tiny_target: Path, drafter_dir: Path, tmp_path: Path):
    dataset = write_jsonl(tmp_path / "ids.jsonl", [{"turns": PROMPTS[:2]}, {"turns": [PROMPTS[2]]}, {"turns": [[9]]}])
    out, trace = tmp_path / "out" / "result.json", tmp_path / "trace.jsonl"
    code = run_cli([
        "eval", "--target", str(tiny_target), "--drafter", str(drafter_dir), "--dataset", str(dataset),
        "--num-prompts", "2", "--max-new-tokens", "12", "--temperature", "1.0", "--block-size", "3",
        "--seed", "7", "--json", str(out), "--trace", str(trace),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    k = 3
    assert result["settings"]["block_size"] == k and result["settings"]["drafter_block_size"] == 4
    assert result["settings"]["temperature"] == 1.0 and result["settings"]["seed"] == 7
    assert result["prompts"] == 2 and result["requests"] == 3
    assert 3 <= result["tokens_generated"] <= 36
    assert 1.0 <= result["tau"] <= k + 1 and result["tau_stderr"] is not None
    for key in ("acceptance_by_position", "reached_by_position", "mean_confidence_by_position",
                "mean_prefix_confidence_by_position", "prefix_survival_by_position"):
        assert len(result[key]) == k, key
    assert sum(result["accepted_histogram"]) == result["rounds"] > 0
    assert {"prefix_confidence_ece", "tau_stderr_iid", "wall_seconds", "has_confidence_head"} <= set(result)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == result["rounds"]
    assert all(len(r["confidences"]) == k and 0 <= r["accepted"] <= k for r in lines)
    assert {r["request"] for r in lines} <= {0, 1, 2}


def test_evaluate_is_reproducible_with_a_seed(tiny_target: Path, drafter_dir: Path, tmp_path: Path):
    dataset = write_jsonl(tmp_path / "ids.jsonl", [{"turns": [p]} for p in PROMPTS])
    settings = EvalSettings(target=tiny_target, drafter=drafter_dir, dataset=dataset, max_new_tokens=10, temperature=1.0)
    first, second = (evaluate(settings, progress=False) for _ in range(2))
    assert first["accepted_histogram"] == second["accepted_histogram"]
    assert first["tokens_generated"] == second["tokens_generated"]


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "dataset not found"),
        ("empty", "holds no prompts"),
        ("malformed", r"bad\.jsonl:2: not valid JSON"),
        ("no_turns", r"bad\.jsonl:1: expected an object with 'turns'"),
        ("text_without_tokenizer", "text turns need a tokenizer"),
        ("block_too_large", "larger than the drafter's block size 4"),
        ("wrong_target", "drafter does not match the target"),
        ("missing_drafter", "drafter directory not found"),
    ],
)
def test_bad_inputs_give_clear_errors(
    case: str, message: str, tiny_target: Path, drafter_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    dataset = tmp_path / "bad.jsonl"
    drafter, extra = drafter_dir, []
    contents = {
        "empty": "\n\n",
        "malformed": '{"turns": [[1, 2]]}\n{"turns": [[1, 2]\n',
        "no_turns": '{"prompt": "hi"}\n',
        "text_without_tokenizer": '{"turns": ["hello"]}\n',
    }
    if case != "missing":
        dataset.write_text(contents.get(case, '{"turns": [[1, 2, 3]]}\n'))
    if case == "block_too_large":
        extra = ["--block-size", "5"]
    if case == "wrong_target":
        drafter = tmp_path / "wrong"
        drafter.mkdir()
        config = json.loads((drafter_dir / "config.json").read_text())
        config["target_layer_ids"] = [1, 9]
        (drafter / "config.json").write_text(json.dumps(config))
    if case == "missing_drafter":
        drafter = tmp_path / "nowhere"
    code = run_cli([
        "eval", "--target", str(tiny_target), "--drafter", str(drafter), "--dataset", str(dataset),
        "--json", str(tmp_path / "out.json"), *extra,
    ])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("eval: error:")
    assert re.search(message, err), err
    assert not (tmp_path / "out.json").exists()
