"""Chain speculative decoding with a fixed verification length K, one sequence at a time.

A round: the drafter reads the target's states at positions before the anchor (the last
token the target produced) and drafts K tokens; the target verifies anchor + K drafts in
one cached forward; the accepted drafts and the target's own next token are kept, the
rejected tail is cropped from the cache. A round's `accepted` is the verifier's outcome
for all K drafts (what the scheduling simulator replays); the text itself is cut at EOS
and at the token budget.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from tqdm import tqdm

from vllm_dspark.config import ConfigError, DrafterConfig
from vllm_dspark.evaluation.dataset import Prompt, load_prompts
from vllm_dspark.evaluation.metrics import summarise_rounds
from vllm_dspark.evaluation.target_runner import IncrementalTarget
from vllm_dspark.evaluation.verification import greedy_verify, rejection_sample
from vllm_dspark.model.drafter import DSparkDrafter, check_drafter_fits_target


@dataclass(frozen=True)
class EvalSettings:
    target: Path
    drafter: Path
    dataset: Path
    num_prompts: int | None = None  # None: every prompt of the dataset
    max_new_tokens: int = 128
    temperature: float = 0.0
    block_size: int | None = None  # K; None: the drafter's block size
    seed: int = 0

    def check(self) -> None:
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class TurnResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)


class SpeculativeDecoder:
    """Target + drafter; `generate` decodes one turn with chain speculation."""

    def __init__(
        self, target: IncrementalTarget, drafter: DSparkDrafter, num_draft: int, temperature: float, stop_ids: set[int]
    ) -> None:
        self.target = target
        self.drafter = drafter.float().eval()
        self.num_draft = num_draft
        self.temperature = temperature
        self.stop_ids = stop_ids
        self._draft_temperature = torch.tensor([temperature]) if temperature > 0 else None

    def _sample(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits / self.temperature, -1), 1, generator=generator))

    def _cut(self, tokens: list[int], budget: int) -> list[int]:
        """Tokens up to and including the first stop token, at most `budget` of them."""
        for i, token in enumerate(tokens[:budget]):
            if token in self.stop_ids:
                return tokens[: i + 1]
        return tokens[:budget]

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator) -> TurnResult:
        target, drafter, k = self.target, self.drafter, self.num_draft
        target.reset()
        logits = target.extend(torch.tensor([prompt_ids]), logits_to_keep=1)
        result = TurnResult(tokens=[self._sample(logits[0, -1], generator)])
        # The drafter always fills its trained block (anchor + block_size masks); slots
        # 0..K-1 predict the K tokens after the anchor.
        while len(result.tokens) < max_new_tokens and result.tokens[-1] not in self.stop_ids:
            anchor = result.tokens[-1]
            position = target.length
            block = drafter.block_input_ids(torch.tensor([[anchor]]), drafter.config.block_size)
            hidden = drafter.backbone(target.context, block, torch.tensor([[position]]))[:, 0, :k]
            draft = drafter.draft(hidden, torch.tensor([anchor]), self._draft_temperature, generator)
            logits = target.extend(torch.cat([torch.tensor([[anchor]]), draft.tokens], dim=1))
            if self.temperature == 0:
                accepted, next_token = greedy_verify(draft.tokens, logits)
            else:
                assert draft.probs is not None
                target_probs = torch.softmax(logits / self.temperature, -1)
                accepted, next_token = rejection_sample(draft.tokens, draft.probs, target_probs, generator)
            n = int(accepted)
            target.crop(position + n + 1)
            result.accepted.append(n)
            result.confidences.append(draft.confidences[0].tolist())
            new = draft.tokens[0, :n].tolist() + [int(next_token)]
            result.tokens += self._cut(new, max_new_tokens - len(result.tokens))
        return result


def load_tokenizer(target_dir: Path) -> Any | None:
    """The target's tokenizer, or None for checkpoints without one (random test models)."""
    if not any((target_dir / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


def stop_token_ids(target_dir: Path, tokenizer: Any | None) -> set[int]:
    """EOS ids of the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def conversation_ids(prompt: Prompt, answers: list[list[int]], tokenizer: Any | None) -> list[int]:
    """Input for turn len(answers): earlier turns with the model's own answers, then the
    next user turn. Text is re-rendered with the chat template, as a chat server does."""
    turn = len(answers)
    if not prompt.is_text:
        ids: list[int] = []
        for user, answer in zip(prompt.turns, answers):
            ids += list(user) + answer
        return ids + list(prompt.turns[turn])
    messages = []
    for user, answer in zip(prompt.turns, answers):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    messages.append({"role": "user", "content": prompt.turns[turn]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_inputs(settings: EvalSettings) -> tuple[DrafterConfig, list[Prompt], Any | None]:
    """Every check that needs no model weights, so bad inputs fail in a second."""
    settings.check()
    prompts = load_prompts(settings.dataset, settings.num_prompts)
    if not Path(settings.target).is_dir():
        raise FileNotFoundError(f"target checkpoint directory not found: {settings.target}")
    if not Path(settings.drafter).is_dir():
        raise FileNotFoundError(f"drafter directory not found: {settings.drafter}")
    config = DrafterConfig.from_dir(settings.drafter)
    check_drafter_fits_target(config, settings.target)
    if settings.block_size is not None and settings.block_size > config.block_size:
        raise ConfigError(
            f"--block-size {settings.block_size} is larger than the drafter's block size {config.block_size}"
        )
    tokenizer = load_tokenizer(Path(settings.target))
    text = [p for p in prompts if p.is_text]
    if text and tokenizer is None:
        raise ValueError(
            f"{settings.dataset}:{text[0].line}: text turns need a tokenizer, and target "
            f"{settings.target} has none; give turns as token-id lists"
        )
    if text and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {settings.target} has no chat template for text turns")
    return config, prompts, tokenizer


def prompt_generator(seed: int, prompt: Prompt) -> torch.Generator:
    """One stream per prompt: the first N prompts give the same numbers whatever N is."""
    return torch.Generator().manual_seed(seed * 1_000_003 + prompt.index)


def write_trace(trace: TextIO, result: TurnResult, request: int) -> None:
    """The scheduling simulator's format; 4 decimals keep the files small."""
    trace.writelines(
        json.dumps({"confidences": [round(c, 4) for c in conf], "accepted": a, "request": request}) + "\n"
        for conf, a in zip(result.confidences, result.accepted)
    )


def evaluate(settings: EvalSettings, trace: TextIO | None = None, progress: bool = True) -> dict[str, Any]:
    """Run the evaluation; returns the result dict written as `--json`. With `trace`, one
    JSON line per round: {"confidences": [c_1..c_K], "accepted": a, "request": turn id}."""
    config, prompts, tokenizer = check_inputs(settings)
    k = settings.block_size or config.block_size
    start = time.perf_counter()
    target = IncrementalTarget.from_pretrained(settings.target, config.target_layer_ids)
    max_positions = min(config.max_position_embeddings, target.model.config.max_position_embeddings)
    decoder = SpeculativeDecoder(
        target,
        DSparkDrafter.from_pretrained(settings.drafter, settings.target),
        num_draft=k,
        temperature=settings.temperature,
        stop_ids=stop_token_ids(Path(settings.target), tokenizer),
    )
    accepted: list[int] = []
    confidences: list[list[float]] = []
    prompt_of_round: list[int] = []
    tokens_generated = requests = 0
    desc = f"eval {Path(settings.dataset).stem} T={settings.temperature}"
    bar = tqdm(prompts, desc=desc, unit="prompt", disable=not progress)
    try:
        for prompt in bar:
            generator = prompt_generator(settings.seed, prompt)
            answers: list[list[int]] = []
            for turn in range(len(prompt.turns)):
                ids = conversation_ids(prompt, answers, tokenizer)
                if len(ids) + settings.max_new_tokens + config.block_size + 1 > max_positions:
                    raise ValueError(
                        f"{settings.dataset}:{prompt.line}: turn {turn + 1} needs {len(ids)} prompt tokens "
                        f"+ {settings.max_new_tokens} new, more than the {max_positions} positions of the models"
                    )
                result = decoder.generate(ids, settings.max_new_tokens, generator)
                if trace is not None:
                    write_trace(trace, result, requests)
                answers.append(result.tokens)
                accepted += result.accepted
                confidences += result.confidences
                prompt_of_round += [prompt.index] * len(result.accepted)
                tokens_generated += len(result.tokens)
                requests += 1
            if accepted:
                bar.set_postfix(tau=f"{np.mean(accepted) + 1:.2f}", rounds=len(accepted))
    finally:
        target.close()
    elapsed = time.perf_counter() - start
    summary = summarise_rounds(
        np.asarray(accepted, dtype=np.int64),
        np.asarray(confidences, dtype=np.float64).reshape(len(accepted), k),
        np.asarray(prompt_of_round),
    )
    settings_out = {key: str(v) if isinstance(v, Path) else v for key, v in asdict(settings).items()}
    settings_out.update(block_size=k, drafter_block_size=config.block_size, markov_rank=config.markov_rank)
    return {
        "settings": settings_out,
        "prompts": len(prompts),
        "requests": requests,
        "tokens_generated": tokens_generated,
        **summary,
        "has_confidence_head": config.enable_confidence_head,
        "confidence_temperatures": config.confidence_temperatures,
        "wall_seconds": round(elapsed, 1),
        "tokens_per_second": round(tokens_generated / elapsed, 2),
    }
