"""Evaluation prompts in the `turns` JSONL format: one JSON object per line whose `turns`
holds the user messages of one conversation (MT-Bench has two).

A turn is text (rendered with the target's chat template) or, for targets without a
tokenizer such as the random test models, a list of token ids used verbatim. The
project's evaluation sets ship in `prompts/` beside this file (see its README.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

Turn = str | list[int]
EVAL_DIR_ENV = "VLLM_DSPARK_EVAL_DIR"


def default_eval_dir() -> Path:
    """The evaluation prompts, for measuring and for keeping out of training data:
    `$VLLM_DSPARK_EVAL_DIR`, else the sets shipped in the package, so that nothing
    outside the installed package is read at run time."""
    env = os.environ.get(EVAL_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parent / "prompts"


@dataclass(frozen=True)
class Prompt:
    index: int  # 0-based among the prompts of the file
    line: int  # 1-based line number, for messages
    turns: tuple[Turn, ...]

    @property
    def is_text(self) -> bool:
        return isinstance(self.turns[0], str)


def _parse_turns(value: object) -> tuple[Turn, ...] | None:
    """The turns if they are all text or all token-id lists, else None."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(t, str) and t for t in value):
        return tuple(value)
    if all(isinstance(t, list) and t and all(isinstance(i, int) and i >= 0 for i in t) for t in value):
        return tuple(list(t) for t in value)
    return None


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[Prompt]:
    """Every line is validated (a bad line fails the run up front, not an hour in); the
    first `num_prompts` prompts are returned."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
            turns = _parse_turns(record.get("turns") if isinstance(record, dict) else None)
            if turns is None:
                raise ValueError(
                    f"{path}:{line_no}: expected an object with 'turns': a non-empty list of "
                    "non-empty strings or of non-empty token-id lists"
                )
            prompts.append(Prompt(index=len(prompts), line=line_no, turns=turns))
    if not prompts:
        raise ValueError(f"dataset {path} holds no prompts")
    return prompts if num_prompts is None else prompts[:num_prompts]
