"""Training-data generation: the prompt mix, the evaluation guard, resumability, a real run."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from vllm_dspark.evaluation.dataset import EVAL_DIR_ENV, default_eval_dir, load_prompts
from vllm_dspark.training import data

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = default_eval_dir()


@pytest.fixture(scope="module")
def mix() -> list[data.PromptItem]:
    return data.build_prompt_mix(300, seed=0)


def test_domain_counts_follow_paper_shares() -> None:
    for n in (1, 7, 100, 999, 6000):
        counts = data.domain_counts(n)
        assert sum(counts.values()) == n
        for domain, share in data.DOMAIN_SHARES.items():
            assert abs(counts[domain] - share * n) < 1


def test_mix_proportions_and_ids(mix: list[data.PromptItem]) -> None:
    assert len(mix) == 300
    assert len({p.id for p in mix}) == 300
    assert Counter(p.domain for p in mix) == data.domain_counts(300)
    assert all(p.id.startswith(p.domain + "-") and p.text.strip() for p in mix)
    # Shuffled across domains, so a partial run still has the intended mix.
    assert len({p.domain for p in mix[:30]}) >= 3


def test_mix_is_deterministic_and_extends(mix: list[data.PromptItem]) -> None:
    assert data.build_prompt_mix(300, seed=0) == mix
    smaller = data.build_prompt_mix(150, seed=0)
    assert {p.id for p in smaller} <= {p.id for p in mix}, "a larger N must reuse a smaller N's work"
    other_seed = data.build_prompt_mix(150, seed=1)
    assert {p.text for p in other_seed} != {p.text for p in smaller}


def test_eval_prompts_ship_with_the_package(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(EVAL_DIR_ENV, raising=False)
    shipped = default_eval_dir()
    assert shipped == REPO / "vllm_dspark" / "evaluation" / "prompts"
    sizes = {name: len(load_prompts(shipped / f"{name}.jsonl")) for name in ("gsm8k", "humaneval", "mt-bench")}
    assert sizes == {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80}
    monkeypatch.setenv(EVAL_DIR_ENV, str(tmp_path))
    assert default_eval_dir() == tmp_path


def test_no_eval_prompt_in_training_mix(mix: list[data.PromptItem]) -> None:
    eval_prompts = [" ".join(p.lower().split()) for p in data.read_eval_prompts(EVAL_DIR)]
    assert len(eval_prompts) > 1000
    for item in mix:
        text = " ".join(item.text.lower().split())
        for prompt in eval_prompts:
            assert text != prompt and prompt not in text and text not in prompt, item.id


def test_eval_guard_catches_copies_and_templated_rewrites() -> None:
    question = (
        "James gets 80 emails a day. 20% of those emails don't require any response. "
        "He responds to the rest of them. How many emails does he respond to in a 5 day week?"
    )
    guard = data.EvalGuard([question, "Write a haiku about autumn leaves falling slowly."])
    assert guard.is_leak(question.upper())
    assert guard.is_leak("Please help.\n" + question + "\nThink step by step.")
    assert guard.is_leak(question.replace("80", "160").replace("20%", "30%").replace("5 day", "6 day"))
    assert guard.is_leak("autumn leaves")  # short text contained in an eval prompt
    assert not guard.is_leak("Explain how a hash map handles collisions, with an example in Python.")
    assert not guard.is_leak("10, 20, 40, 80, 160, 320, ?")


def test_sharegpt_reader_recovers_records_from_truncated_file(tmp_path: Path) -> None:
    records = [{"id": f"a{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(2)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"q1"') + 2]  # cut off inside the second record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    assert [r["id"] for r in data.iter_sharegpt(path)] == ["a0_0"]
    path.write_text(text)
    assert [r["id"] for r in data.iter_sharegpt(path)] == ["a0_0", "a1_0"]


def test_completed_ids_cuts_torn_last_line(tmp_path: Path) -> None:
    out = tmp_path / "train.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "resp')
    assert data.completed_ids(out) == {"a", "b"}
    assert out.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    data.register_cli(parser.add_subparsers())
    args = parser.parse_args(["generate-data", *argv])
    return args.func(args)


def test_cli_rejects_bad_inputs(tmp_path: Path, capsys) -> None:
    assert _run_cli(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o.jsonl")]) == 1
    assert "target checkpoint directory not found" in capsys.readouterr().err

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _run_cli(["--target", str(tmp_path), "--out", str(blocker / "o.jsonl")]) == 1
    assert "cannot write output file" in capsys.readouterr().err

    for bad in ("0", "-3"):
        with pytest.raises(SystemExit):
            _run_cli(["--num-prompts", bad])
        assert "must be a positive integer" in capsys.readouterr().err


def test_real_generation_and_resume(tmp_path: Path) -> None:
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    cache = REPO / ".cache"
    # tests/conftest.py sets the vLLM environment (caches in .cache, offline, CPU KV space).
    target = smollm2_checkpoint(os.environ.get("VLLM_DSPARK_CACHE") or cache / "vllm-dspark")
    prompts = [
        data.PromptItem("chat-t-1", "chat", "test", "What is the capital of France?"),
        data.PromptItem("math-t-1", "math", "test", "What is 12 + 30?"),
        data.PromptItem("code-t-1", "code", "test", "Write a Python function that adds two numbers."),
    ]
    out = tmp_path / "train.jsonl"
    stats = data.generate_responses(
        prompts, target, out, max_new_tokens=16, temperature=0.0, batch_size=2,
        kv_cache_gib=0.0625,
    )
    assert stats.written == 3 and stats.response_tokens > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["chat-t-1", "code-t-1", "math-t-1"]
    for r in records:
        assert 0 < r["response_tokens"] == len(r["response_token_ids"]) <= 16
        assert r["prompt_tokens"] == len(r["prompt_token_ids"])
        assert r["messages"][0]["role"] == "user" and r["response"].strip()
    by_id = {r["id"]: r for r in records}
    assert "Paris" in by_id["chat-t-1"]["response"]

    again = data.generate_responses(prompts, target, out, max_new_tokens=16, temperature=0.0)
    assert (again.written, again.skipped_done) == (0, 3)


def test_teacher_forced_records_from_sharegpt_replies(smollm2_target: Path, tmp_path: Path, monkeypatch) -> None:
    """ShareGPT replies become generate-data records: opening exchanges only, English, not
    used by the corpus, not overlapping the evaluation prompts, cut at the reply limit (else
    closed with the end-of-turn token), until the token budget is out."""
    from transformers import AutoTokenizer

    from vllm_dspark.training import teacher_forced

    def conversation(conv_id: str, user: str, reply: str) -> dict:
        return {"id": conv_id, "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}

    eval_question = "What is the capital city of France and why did it become the capital?"
    sharegpt = [
        conversation("keep_0", "Explain what a hash map is, briefly please.", "A hash map stores key-value pairs."),
        conversation("keep_1", "A later chunk opens mid-conversation, so skip it.", "It is skipped entirely."),
        conversation("used_0", "This conversation was a prompt of the corpus.", "So it is left out here."),
        conversation("eval_0", eval_question, "Paris, because the kings lived there."),
        conversation("foreign_0", "Объясни, пожалуйста, как работает хеш-таблица.", "Хеш-таблица хранит пары."),
        conversation("long_0", "Count from one to a very large number for me.", " ".join(["one two three"] * 200)),
        conversation("late_0", "Anything after the budget is spent is not read.", "Never written."),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt))
    monkeypatch.setattr(teacher_forced, "sharegpt_path", lambda: path)
    corpus = tmp_path / "train.jsonl"
    corpus.write_text(json.dumps({"id": "chat-sharegpt-used_0"}) + "\n" + json.dumps({"id": "math-x-1"}) + "\n")
    assert teacher_forced.conversation_ids(corpus) == {"used_0"}
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "set.jsonl").write_text(json.dumps({"turns": [eval_question]}) + "\n")

    out = tmp_path / "teacher.jsonl"
    stats = teacher_forced.write_teacher_forced(
        smollm2_target, out, response_tokens=40, max_reply_tokens=32, exclude=corpus, eval_dir=eval_dir
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["teacher-sharegpt-assistant-keep_0", "teacher-sharegpt-assistant-long_0"]
    assert (stats.written, stats.skipped_used, stats.skipped_eval, stats.truncated) == (2, 1, 1, 1)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_target))
    short, long = records
    prompt = tokenizer.apply_chat_template(short["messages"], tokenize=False, add_generation_prompt=True)
    assert short["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert short["response_token_ids"][-1] == tokenizer.eos_token_id and short["finish_reason"] == "stop"
    assert tokenizer.decode(short["response_token_ids"][:-1]) == "A hash map stores key-value pairs."
    assert len(long["response_token_ids"]) == 32 and long["finish_reason"] == "length"
    assert stats.response_tokens == sum(len(r["response_token_ids"]) for r in records) >= 40
    assert all(r["sampling"]["teacher_forced"] for r in records)
