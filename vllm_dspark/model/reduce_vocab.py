"""`vllm-dspark reduce-vocab`: a reduced-draft-vocabulary drafter from a full-vocabulary one.

On a CPU the drafter's LM head dominates a drafting step: every position streams the whole
49K x d matrix. A drafter that can only propose the N tokens the target emits most often
pays N / V of that, and loses only the drafts it could never have proposed: the target's
probability mass outside the subset. Verification stays exact, since the draft
distribution handed to rejection sampling is the one actually sampled (zero outside).

The subset is the N most frequent tokens of the target's own generations (a corpus written
by `generate-data`; held-out records never count) plus the target's special tokens. The
checkpoint is written in the format vLLM's DSpark model loads: `draft_vocab_size` in the
config, `lm_head.weight` (the target's LM head rows of the subset), `d2t` (target id =
draft id + d2t[draft id]), the Markov W2 rows of the subset; W1 still covers the target
vocabulary, since it embeds the previous token, a target id.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vllm_dspark.cli import positive_int
from vllm_dspark.config import ConfigError, DrafterConfig
from vllm_dspark.model.drafter import D2T, WEIGHTS_FILE, read_target_config, read_target_embeddings
from vllm_dspark.training.features import FeatureError, heldout_score, iter_records

logger = logging.getLogger(__name__)

MARKOV_W2 = "markov_head.markov_w2.weight"
LM_HEAD = "lm_head.weight"
HELDOUT_FRAC = 0.05  # the calibration split's share (`extract-features --heldout-frac 0.05`)
REPORT_SIZES = (2048, 4096, 8192, 16384, 32768)
COPIED_FILES = ("calibration.json", "reliability.png", "train_log.jsonl")


def token_counts(corpus: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of each target token in the responses, (training records, held-out records);
    held out as for calibration (`heldout_score` below `HELDOUT_FRAC`)."""
    train, heldout = np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64)
    for record in iter_records(corpus, max_seq_len=sys.maxsize):
        ids = np.asarray(record.input_ids[record.response_start:], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ConfigError(f"{corpus}: record {record.id} has token ids outside the target vocabulary")
        np.add.at(heldout if heldout_score(record.id) < HELDOUT_FRAC else train, ids, 1)
    return train, heldout


def special_token_ids(target_config: dict) -> list[int]:
    """bos/eos/pad ids of the target config (lists allowed): the drafter must be able to
    propose the end of a response."""
    ids: list[int] = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = target_config.get(key)
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return sorted(set(ids))


def choose_draft_vocab(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """The `size` most frequent ids (ties by id), always including `always`, sorted by id."""
    if size > len(counts):
        raise ConfigError(f"draft vocabulary of {size} is larger than the target vocabulary ({len(counts)})")
    if len(always) > size:
        raise ConfigError(f"draft vocabulary of {size} cannot hold the {len(always)} special tokens")
    order = np.lexsort((np.arange(len(counts)), -counts))
    chosen = list(dict.fromkeys([*always, *order.tolist()]))[:size]
    return np.sort(np.array(chosen, dtype=np.int64))


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens inside the subset."""
    total = counts.sum()
    return float(counts[ids].sum() / total) if total else float("nan")


def reduce_drafter(drafter_dir: Path, target_dir: Path, draft_ids: np.ndarray, out_dir: Path) -> DrafterConfig:
    """Write the reduced-vocabulary checkpoint of a full-vocabulary drafter."""
    config = DrafterConfig.from_dir(drafter_dir)
    if config.reduced_vocab:
        raise ConfigError(f"{drafter_dir} already has a reduced vocabulary ({config.draft_vocab} tokens)")
    state = load_file(str(drafter_dir / WEIGHTS_FILE))
    _, lm_head = read_target_embeddings(target_dir, config)
    ids = torch.from_numpy(draft_ids)
    dtype = next(iter(state.values())).dtype
    state[LM_HEAD] = lm_head[ids].to(dtype).contiguous()
    if MARKOV_W2 in state:
        state[MARKOV_W2] = state[MARKOV_W2][ids].contiguous()
    state[D2T] = ids - torch.arange(len(ids))
    reduced = config.model_copy(update={"draft_vocab_size": len(ids)})
    out_dir.mkdir(parents=True, exist_ok=True)
    reduced.save(out_dir)
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    for name in COPIED_FILES:
        if (drafter_dir / name).is_file():
            shutil.copy2(drafter_dir / name, out_dir / name)
    return reduced


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reduce-vocab", help="derive a reduced-draft-vocabulary drafter from a full-vocabulary one"
    )
    parser.add_argument("--drafter", type=Path, required=True, help="full-vocabulary drafter directory")
    parser.add_argument("--target", type=Path, default=None, help="target checkpoint (default: SmolLM2)")
    parser.add_argument("--corpus", type=Path, required=True,
                        help="generate-data JSONL (or .jsonl.xz) of the target's own responses")
    parser.add_argument("--size", type=positive_int, required=True, help="draft vocabulary size N")
    parser.add_argument("--out", type=Path, required=True)
    parser.set_defaults(func=_run)


@dataclass(frozen=True)
class DraftVocabChoice:
    """A subset picked from a corpus, with the held-out coverage of a few sizes."""

    ids: np.ndarray  # sorted target ids
    training_tokens: int
    heldout_tokens: int
    heldout_coverage: dict[int, float]  # size -> share of held-out response tokens inside

    def summary(self, reduced: DrafterConfig, corpus: Path) -> dict:
        return {
            "draft_vocab_size": reduced.draft_vocab,
            "target_vocab_size": reduced.vocab_size,
            "corpus": str(corpus),
            "training_tokens": self.training_tokens,
            "heldout_tokens": self.heldout_tokens,
            "heldout_coverage_by_size": {str(k): round(v, 5) for k, v in self.heldout_coverage.items()},
        }


def choose_from_corpus(corpus: Path, target_dir: Path, size: int) -> DraftVocabChoice:
    """The `size` tokens most frequent in the corpus's training records, and the held-out
    coverage of the report sizes (and of `size`) to choose N from."""
    target_config = read_target_config(target_dir)
    train, heldout = token_counts(corpus, target_config["vocab_size"])
    special = special_token_ids(target_config)
    report = {
        n: coverage(heldout, choose_draft_vocab(train, n, special))
        for n in sorted({*REPORT_SIZES, size})
        if n <= len(train)
    }
    return DraftVocabChoice(choose_draft_vocab(train, size, special), int(train.sum()), int(heldout.sum()), report)


def reduce_with_report(drafter_dir: Path, target_dir: Path, corpus: Path, size: int, out_dir: Path) -> DrafterConfig:
    """Pick the subset from `corpus`, write the reduced drafter and its `draft_vocab.json`,
    and print the held-out coverage by size (what N is chosen from)."""
    choice = choose_from_corpus(corpus, target_dir, size)
    reduced = reduce_drafter(drafter_dir, target_dir, choice.ids, out_dir)
    (out_dir / "draft_vocab.json").write_text(json.dumps(choice.summary(reduced, corpus), indent=2) + "\n")
    for n, share in choice.heldout_coverage.items():
        print(f"N={n:6d}: {100 * share:6.2f}% of held-out target tokens inside the draft vocabulary")
    return reduced


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.target is None:
            from vllm_dspark.targets.smollm2 import smollm2_checkpoint

            args.target = smollm2_checkpoint()
        reduced = reduce_with_report(args.drafter, args.target, args.corpus, args.size, args.out)
    except (ConfigError, FeatureError, OSError, ValueError) as exc:
        print(f"reduce-vocab: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (draft_vocab_size {reduced.draft_vocab})")
    return 0
