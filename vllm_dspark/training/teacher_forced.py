"""Teacher-forced records: ShareGPT's own assistant replies, labelled by the target later.

The core corpus holds the target's own answers (DSPARK.md section 2: a drafter learns to
imitate the target). Text the target did not write can still add volume: extract-features
runs the target over it and stores the target's next-token distribution at every position,
so the soft labels stay the target's while the contexts are human-written chat. Whether
that helps a drafter that is judged on the target's own text is an empirical question;
`examples/drafters/README.md` records the A/B.

Records have the layout `generate-data` writes (id, prompt and response token ids), so
`extract-features` reads them unchanged; `sampling.teacher_forced` marks them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vllm_dspark.cli import positive_int
from vllm_dspark.training.data import (
    MAX_CHAT_CHARS,
    check_target,
    check_writable,
    eval_guard,
    iter_sharegpt,
    mostly_ascii,
    opening_user_turn,
    sharegpt_path,
)

logger = logging.getLogger(__name__)

SOURCE = "sharegpt-assistant"


@dataclass(frozen=True)
class Exchange:
    """The opening user turn of a ShareGPT conversation and the reply to it."""

    conv_id: str
    user: str
    reply: str


def opening_exchanges(records: Iterator[dict[str, Any]]) -> Iterator[Exchange]:
    """First user turn and first assistant reply of every conversation's first chunk, in
    English, short enough for a 2K context; later chunks open mid-conversation."""
    for record in records:
        user = opening_user_turn(record)
        turns = record.get("conversations") or []
        if user is None or len(turns) < 2 or turns[1].get("from") not in ("gpt", "assistant"):
            continue
        reply = str(turns[1].get("value", "")).strip()
        if len(user) < 16 or len(user) > MAX_CHAT_CHARS or len(reply) < 16:
            continue
        if mostly_ascii(user) and mostly_ascii(reply):
            yield Exchange(str(record["id"]), user, reply)


def conversation_ids(corpus: Path) -> set[str]:
    """ShareGPT conversation ids a generated corpus already used as prompts."""
    used: set[str] = set()
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            record_id = json.loads(line)["id"] if line.strip() else ""
            if "-sharegpt-" in record_id:
                used.add(record_id.split("-sharegpt-", 1)[1])
    return used


@dataclass
class BuildStats:
    written: int = 0
    response_tokens: int = 0
    truncated: int = 0
    skipped_used: int = 0
    skipped_eval: int = 0


def write_teacher_forced(
    target: Path,
    out: Path,
    *,
    response_tokens: int,
    max_reply_tokens: int = 256,
    exclude: Path | None = None,
    eval_dir: Path | None = None,
) -> BuildStats:
    """Write records until `response_tokens` reply tokens are out: the user turn under the
    target's chat template as the prompt, the reply (cut at `max_reply_tokens`, the
    generated corpus's limit, else closed with the end-of-turn token) as the response."""
    from transformers import AutoTokenizer

    check_target(target)
    check_writable(out)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{target}: the tokenizer has no end-of-turn (eos) token")
    guard = eval_guard(eval_dir)
    used = conversation_ids(exclude) if exclude is not None else set()
    stats = BuildStats()
    with open(out, "w", encoding="utf-8") as f:
        for exchange in opening_exchanges(iter_sharegpt(sharegpt_path())):
            if stats.response_tokens >= response_tokens:
                break
            if exchange.conv_id in used:
                stats.skipped_used += 1
                continue
            if guard is not None and (guard.is_leak(exchange.user) or guard.is_leak(exchange.reply)):
                stats.skipped_eval += 1
                continue
            messages = [{"role": "user", "content": exchange.user}]
            prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
            reply_ids = tokenizer.encode(exchange.reply, add_special_tokens=False)
            truncated = len(reply_ids) >= max_reply_tokens
            reply_ids = reply_ids[:max_reply_tokens] if truncated else reply_ids + [tokenizer.eos_token_id]
            record = {
                "id": f"teacher-{SOURCE}-{exchange.conv_id}",
                "domain": "chat",
                "source": SOURCE,
                "messages": messages,
                "response": tokenizer.decode(reply_ids, skip_special_tokens=True),
                "finish_reason": "length" if truncated else "stop",
                "prompt_tokens": len(prompt_ids),
                "response_tokens": len(reply_ids),
                "prompt_token_ids": prompt_ids,
                "response_token_ids": reply_ids,
                "target": target.name,
                "sampling": {"teacher_forced": True, "max_new_tokens": max_reply_tokens},
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            stats.written += 1
            stats.response_tokens += len(reply_ids)
            stats.truncated += truncated
    return stats


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the `teacher-forced-data` subcommand."""
    parser = subparsers.add_parser(
        "teacher-forced-data",
        help="ShareGPT's own assistant replies as records for extract-features (labels come from the target)",
    )
    parser.add_argument("--target", type=Path, default=None,
                        help="HF checkpoint of the target (default: the SmolLM2 checkpoint)")
    parser.add_argument("--out", type=Path, required=True, help="JSONL output (overwritten)")
    parser.add_argument("--response-tokens", type=positive_int, default=300_000,
                        help="stop once this many reply tokens are written")
    parser.add_argument("--max-reply-tokens", type=positive_int, default=256)
    parser.add_argument("--exclude", type=Path, default=None,
                        help="a generate-data corpus whose ShareGPT conversations are left out")
    parser.add_argument("--eval-dir", type=Path, default=None, help="evaluation prompts to keep out")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.target is None:
            from vllm_dspark.targets.smollm2 import smollm2_checkpoint

            args.target = smollm2_checkpoint()
        stats = write_teacher_forced(
            args.target, args.out, response_tokens=args.response_tokens,
            max_reply_tokens=args.max_reply_tokens, exclude=args.exclude, eval_dir=args.eval_dir,
        )
    except (OSError, ValueError) as exc:
        print(f"teacher-forced-data: {exc}", file=sys.stderr)
        return 1
    logger.info(
        "wrote %d records, %d reply tokens (%d cut at the limit); left out %d conversations the "
        "corpus used and %d that overlap evaluation prompts", stats.written, stats.response_tokens,
        stats.truncated, stats.skipped_used, stats.skipped_eval,
    )
    return 0 if stats.written else 1

