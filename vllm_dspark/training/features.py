"""Target features for drafter training: cached on disk in bf16 shards, or computed on the fly.

The drafter reads the target's hidden states at `target_layer_ids` (its context) and is
trained against the target's next-token distribution (DSPARK.md section 2), kept as its
top k probabilities per position (soft_labels.py; the TV loss's bound is in losses.py).
Running the target is the slow part on a CPU, so `vllm-dspark extract-features` runs it
once per record, LM head included, and stores:

    DIR/meta.json                 target fingerprint, layer ids, sizes, dtype, soft_label_topk
    DIR/index.jsonl               one line per sequence: id, shard, key, length, response_start
    DIR/shard-00000.safetensors   per sequence "<key>.input_ids" (int32), "<key>.context"
                                  [T, m*d] (bf16), "<key>.topk_ids" [T, k] (int32) and
                                  "<key>.topk_probs" [T, k] (fp16)

Memory stays bounded whatever the data size: records are streamed, a shard is flushed
once it holds `shard_tokens` tokens, and readers memory-map one tensor at a time. A shard
is renamed into place before its index lines are appended, so a killed run resumes from
the last complete shard. The loss mask is "response tokens only": positions >= response_start.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import logging
import lzma
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from vllm_dspark.cli import positive_int
from vllm_dspark.config import ConfigError, DrafterConfig
from vllm_dspark.model.drafter import read_target_config
from vllm_dspark.model.init_drafter import spread_layer_ids
from vllm_dspark.model.target_features import capture_target_states
from vllm_dspark.training.distributed import PRECISIONS, DeviceError, autocast, uses_bf16
from vllm_dspark.training.soft_labels import DEFAULT_TOPK, TopKProbs

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
INDEX_FILE = "index.jsonl"
FORMAT_VERSION = 2  # 1 stored the last hidden state instead of top-k soft labels
STORE_DTYPE = torch.bfloat16
PROBS_DTYPE = torch.float16  # probabilities in [0, 1]: 11 significant bits


class FeatureError(ValueError):
    """Bad training data or features; the message names the file and what is wrong."""


# ------------------------------------------------------------------ records and splits
@dataclass
class TokenRecord:
    """One training sequence: prompt followed by the target's response."""

    id: str
    input_ids: list[int]
    response_start: int
    domain: str = ""  # the record's domain (math, code, chat, ...) where it names one


def iter_records(path: Path, max_seq_len: int) -> Iterator[TokenRecord]:
    """Stream a generate-data JSONL file (plain or, like the committed corpus, .xz).
    Sequences are cut to `max_seq_len` tokens; records with no response token left are
    skipped. A last line without a newline is a record still being written by generate-data
    and is left for a later run."""
    if not path.is_file():
        raise FeatureError(f"training data not found: {path}")
    with (lzma.open if path.suffix == ".xz" else open)(path, "rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            if not raw.endswith(b"\n"):
                logger.info("%s:%d is incomplete (still being written); stopping there", path, line_no)
                return
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                prompt, response = record["prompt_token_ids"], record["response_token_ids"]
                record_id = str(record["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise FeatureError(
                    f"{path}:{line_no}: not a generate-data record (need id, prompt_token_ids, "
                    f"response_token_ids): {exc}"
                ) from exc
            if not prompt or not response:
                continue
            ids = (list(prompt) + list(response))[:max_seq_len]
            if len(ids) > len(prompt):
                yield TokenRecord(record_id, ids, len(prompt), str(record.get("domain", "")))


def heldout_score(record_id: str) -> float:
    """A stable number in [0, 1) per id, so the held-out split never depends on file order."""
    digest = hashlib.sha1(record_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ------------------------------------------------------------------ target fingerprint
def target_fingerprint(target_dir: Path) -> dict[str, Any]:
    """What features depend on: the target's shape and its tokenizer (hashed)."""
    config = read_target_config(target_dir)
    tokenizer_hash = None
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        file = Path(target_dir) / name
        if file.is_file():
            tokenizer_hash = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
            break
    return {
        "model_type": config.get("model_type"),
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "tokenizer_sha256": tokenizer_hash,
    }


def _describe(fingerprint: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fingerprint.items())


# ------------------------------------------------------------------ sequences
@dataclass
class SequenceFeatures:
    """Everything training needs for one sequence, in fp32 (compute dtype)."""

    input_ids: torch.Tensor  # [T] int64
    context: torch.Tensor  # [T, m * d] target states at the drafter's layers
    soft_labels: TopKProbs  # [T, k] the target's next-token distribution after each position
    response_start: int  # loss mask: positions >= response_start

    @property
    def loss_mask(self) -> torch.Tensor:
        return torch.arange(len(self.input_ids)) >= self.response_start


class FeatureSource(Protocol):
    """Anything that hands out sequences by index (disk cache or live target)."""

    layer_ids: list[int]
    fingerprint: dict[str, Any]

    def __len__(self) -> int: ...

    def lengths(self) -> list[tuple[int, int]]:
        """(length, response_start) of every sequence, without loading features."""
        ...

    def get(self, index: int) -> SequenceFeatures: ...


def check_same_target(source: FeatureSource, target_dir: Path, where: str) -> dict[str, Any]:
    """Features must come from this target: same shape and same tokenizer."""
    expected = target_fingerprint(target_dir)
    if source.fingerprint != expected:
        raise FeatureError(
            f"features in {where} were extracted from a different target or tokenizer:\n"
            f"  features: {_describe(source.fingerprint)}\n  --target: {_describe(expected)}"
        )
    return expected


def check_source_fits(source: FeatureSource, config: DrafterConfig, target_dir: Path, where: str) -> None:
    """Features from this target, at the layers the drafter reads."""
    expected = check_same_target(source, target_dir, where)
    if list(source.layer_ids) != list(config.target_layer_ids):
        raise FeatureError(
            f"features in {where} hold target layers {source.layer_ids}, the drafter reads "
            f"target_layer_ids {config.target_layer_ids}; extract features at those layers"
        )
    config.check_fits_target(
        hidden_size=expected["hidden_size"],
        vocab_size=expected["vocab_size"],
        num_layers=expected["num_hidden_layers"],
    )


# ------------------------------------------------------------------ target model
def load_target(target_dir: Path, device: torch.device = torch.device("cpu")) -> torch.nn.Module:
    """The frozen target in eval mode: fp32 weights on a CPU (extract-features can still run
    it under bf16 autocast), bf16 on a GPU (what the feature store keeps anyway)."""
    from transformers import AutoModelForCausalLM

    if not (Path(target_dir) / "config.json").is_file():
        raise FeatureError(f"target checkpoint not found (no config.json): {target_dir}")
    dtype = torch.float32 if device.type == "cpu" else STORE_DTYPE
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


@torch.no_grad()
def run_target(
    model: torch.nn.Module, sequences: list[list[int]], layer_ids: list[int], topk: int
) -> list[tuple[torch.Tensor, TopKProbs]]:
    """Context states and top-k soft labels per sequence from one right-padded batch, on
    the CPU wherever the target runs (like features read from disk). Causal attention
    means the padding after a sequence cannot change its states."""
    longest = max(len(s) for s in sequences)
    batch = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, ids in enumerate(sequences):
        batch[row, : len(ids)] = torch.tensor(ids)
    context, last = capture_target_states(model, batch.to(model.device), layer_ids)
    labels = TopKProbs.from_logits(model.get_output_embeddings()(last.to(model.dtype)), topk).to(torch.device("cpu"))
    context = context.cpu()
    return [(context[row, : len(ids)], labels[row, : len(ids)]) for row, ids in enumerate(sequences)]


# ------------------------------------------------------------------ disk store
class FeatureWriter:
    """Appends sequences to a feature directory in shards of bounded size; resumable."""

    def __init__(self, out_dir: Path, meta: dict[str, Any], shard_tokens: int) -> None:
        self.out_dir = Path(out_dir)
        self.shard_tokens = shard_tokens
        self.out_dir.mkdir(parents=True, exist_ok=True)
        meta_path = self.out_dir / META_FILE
        if meta_path.is_file():
            old = json.loads(meta_path.read_text())
            if old != meta:
                diff = {k: (old.get(k), meta.get(k)) for k in set(old) | set(meta) if old.get(k) != meta.get(k)}
                raise FeatureError(
                    f"{self.out_dir} already holds features made differently (old, new): {diff}; "
                    "use another --out to start afresh"
                )
        else:
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        for stale in self.out_dir.glob("*.tmp"):
            stale.unlink()  # a shard that was being written when a run was killed
        entries = read_index(self.out_dir)
        self.done_ids = {e["id"] for e in entries}
        self.tokens = sum(e["length"] for e in entries)
        self.next_shard = 1 + max((int(e["shard"][6:11]) for e in entries), default=-1)
        self._tensors: dict[str, torch.Tensor] = {}
        self._entries: list[dict[str, Any]] = []
        self._buffered_tokens = 0

    def add(self, record: TokenRecord, context: torch.Tensor, soft_labels: TopKProbs) -> None:
        key = str(len(self._entries))
        self._tensors[f"{key}.input_ids"] = torch.tensor(record.input_ids, dtype=torch.int32)
        self._tensors[f"{key}.context"] = context.to(STORE_DTYPE).contiguous()
        self._tensors[f"{key}.topk_ids"] = soft_labels.ids.to(torch.int32).contiguous()
        self._tensors[f"{key}.topk_probs"] = soft_labels.probs.to(PROBS_DTYPE).contiguous()
        self._entries.append(
            {"id": record.id, "key": key, "length": len(record.input_ids), "response_start": record.response_start}
        )
        self.done_ids.add(record.id)
        self.tokens += len(record.input_ids)
        self._buffered_tokens += len(record.input_ids)
        if self._buffered_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._entries:
            return
        name = f"shard-{self.next_shard:05d}.safetensors"
        tmp = self.out_dir / (name + ".tmp")
        save_file(self._tensors, str(tmp))
        tmp.rename(self.out_dir / name)
        with open(self.out_dir / INDEX_FILE, "a", encoding="utf-8") as index:
            for entry in self._entries:
                index.write(json.dumps({**entry, "shard": name}) + "\n")
        self.next_shard += 1
        self._tensors, self._entries, self._buffered_tokens = {}, [], 0


def read_index(feature_dir: Path) -> list[dict[str, Any]]:
    path = Path(feature_dir) / INDEX_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FeatureStore:
    """Reads a feature directory written by `extract-features`, one sequence at a time."""

    def __init__(self, feature_dir: str | Path) -> None:
        self.dir = Path(feature_dir)
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise FeatureError(f"no features in {self.dir} ({META_FILE} missing); run extract-features")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise FeatureError(
                f"{meta_path}: format_version {self.meta.get('format_version')}, this version reads "
                f"{FORMAT_VERSION} (top-k soft labels); run extract-features again into a new directory"
            )
        self.layer_ids: list[int] = self.meta["layer_ids"]
        self.fingerprint: dict[str, Any] = self.meta["target"]
        self.entries = read_index(self.dir)
        if not self.entries:
            raise FeatureError(f"{self.dir} holds no sequences (empty {INDEX_FILE})")
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def lengths(self) -> list[tuple[int, int]]:
        return [(e["length"], e["response_start"]) for e in self.entries]

    def get(self, index: int) -> SequenceFeatures:
        entry = self.entries[index]
        shard = entry["shard"]
        if shard not in self._handles:
            path = self.dir / shard
            if not path.is_file():
                raise FeatureError(f"feature shard missing: {path}")
            self._handles[shard] = safe_open(str(path), framework="pt")
        handle, key = self._handles[shard], entry["key"]
        return SequenceFeatures(
            input_ids=handle.get_tensor(f"{key}.input_ids").long(),
            context=handle.get_tensor(f"{key}.context").float(),
            soft_labels=TopKProbs(handle.get_tensor(f"{key}.topk_ids").long(), handle.get_tensor(f"{key}.topk_probs").float()),
            response_start=entry["response_start"],
        )


class FeatureUnion:
    """Several feature directories read as one source (the generated corpus and
    teacher-forced text, say). They must agree on everything a step's arithmetic depends on,
    so that no sequence is read differently from the others."""

    MUST_AGREE = ("format_version", "target", "layer_ids", "soft_label_topk", "target_precision")

    def __init__(self, stores: list[FeatureStore]) -> None:
        if not stores:
            raise FeatureError("no feature directories given")
        first = stores[0]
        for store in stores[1:]:
            for key in self.MUST_AGREE:
                if store.meta.get(key) != first.meta.get(key):
                    raise FeatureError(
                        f"feature directories disagree on {key}: {first.dir} has {first.meta.get(key)}, "
                        f"{store.dir} has {store.meta.get(key)}; extract them with the same settings"
                    )
        self.stores = stores
        self.layer_ids: list[int] = first.layer_ids
        self.fingerprint: dict[str, Any] = first.fingerprint
        self._starts = [0]
        for store in stores:
            self._starts.append(self._starts[-1] + len(store))

    def __len__(self) -> int:
        return self._starts[-1]

    def lengths(self) -> list[tuple[int, int]]:
        return [pair for store in self.stores for pair in store.lengths()]

    def get(self, index: int) -> SequenceFeatures:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)}")
        which = bisect.bisect_right(self._starts, index) - 1
        return self.stores[which].get(index - self._starts[which])


def open_features(dirs: list[Path]) -> FeatureStore | FeatureUnion:
    """One directory as a FeatureStore, several as their union."""
    stores = [FeatureStore(d) for d in dirs]
    return stores[0] if len(stores) == 1 else FeatureUnion(stores)


class OnTheFlyFeatures:
    """Runs the target for each requested sequence instead of reading a cache: no disk,
    but every epoch pays the target forward again (on `device`, the one training uses).
    Only token ids stay in memory."""

    def __init__(
        self,
        target_dir: Path,
        data: Path,
        layer_ids: list[int],
        max_seq_len: int,
        heldout_frac: float = 0.0,
        device: torch.device = torch.device("cpu"),
        topk: int = DEFAULT_TOPK,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.topk = topk
        self.fingerprint = target_fingerprint(target_dir)
        self.records = []
        for record in iter_records(data, max_seq_len):
            if heldout_score(record.id) >= heldout_frac:  # never train on the calibration split
                check_vocabulary(record, self.fingerprint["vocab_size"], data)
                self.records.append((torch.tensor(record.input_ids, dtype=torch.int32), record.response_start))
        if not self.records:
            raise FeatureError(f"no usable records in {data}")
        self.model = load_target(target_dir, device)

    def __len__(self) -> int:
        return len(self.records)

    def lengths(self) -> list[tuple[int, int]]:
        return [(len(ids), start) for ids, start in self.records]

    def get(self, index: int) -> SequenceFeatures:
        ids, start = self.records[index]
        [(context, labels)] = run_target(self.model, [ids.tolist()], self.layer_ids, self.topk)
        return SequenceFeatures(ids.long(), context, labels, start)


def check_vocabulary(record: TokenRecord, vocab_size: int, where: Path) -> None:
    if max(record.input_ids) >= vocab_size:
        raise FeatureError(
            f"record {record.id} in {where} holds token id {max(record.input_ids)}, the target's "
            f"vocabulary has {vocab_size} entries: the data was tokenised for a different model"
        )


# ------------------------------------------------------------------ extraction
@dataclass
class ExtractStats:
    sequences: int = 0
    tokens: int = 0
    response_tokens: int = 0
    skipped_done: int = 0
    seconds: float = 0.0


def extract_features(
    target_dir: Path,
    data: Path,
    out_dir: Path,
    *,
    layer_ids: list[int] | None = None,
    heldout_dir: Path | None = None,
    heldout_frac: float = 0.0,
    max_seq_len: int = 2048,
    max_tokens: int | None = None,
    batch_tokens: int = 2048,
    shard_tokens: int = 32768,
    topk: int = DEFAULT_TOPK,
    precision: str = "auto",
) -> ExtractStats:
    """Stream `data`, run the target and write features; records whose id hashes below
    `heldout_frac` go to `heldout_dir` (for calibration), the rest to `out_dir`. Stops
    after `max_tokens` tokens in total (both splits, earlier runs included). `precision`
    bf16 runs the target under bf16 autocast (CPUs with native bf16 products: 1.85x the
    tokens per second here; the store keeps bf16 states anyway)."""
    if (heldout_dir is None) != (heldout_frac == 0.0):
        raise FeatureError("give --heldout-out and --heldout-frac together")
    if not 0.0 <= heldout_frac < 1.0:
        raise FeatureError(f"--heldout-frac must be in [0, 1), got {heldout_frac}")
    device = torch.device("cpu")
    bf16 = uses_bf16(device, precision)
    fingerprint = target_fingerprint(target_dir)
    layer_ids = layer_ids or spread_layer_ids(fingerprint["num_hidden_layers"])
    bad = [i for i in layer_ids if not -1 <= i < fingerprint["num_hidden_layers"]]
    if bad or sorted(set(layer_ids)) != list(layer_ids):
        raise FeatureError(
            f"--layers {layer_ids}: need strictly increasing ids in -1..{fingerprint['num_hidden_layers'] - 1}"
        )
    meta = {
        "format_version": FORMAT_VERSION,
        "target": fingerprint,
        "layer_ids": list(layer_ids),
        "dtype": "bfloat16",
        "max_seq_len": max_seq_len,
        "soft_label_topk": topk,
        "target_precision": "bf16" if bf16 else "fp32",
    }
    writers = {"train": FeatureWriter(out_dir, meta, shard_tokens)}
    if heldout_dir is not None:
        writers["heldout"] = FeatureWriter(heldout_dir, {**meta, "heldout_frac": heldout_frac}, shard_tokens)
    total_records = sum(1 for _ in open(data, "rb")) if Path(data).is_file() else 0
    model = load_target(target_dir, device)
    stats = ExtractStats()
    start = time.perf_counter()
    bar = tqdm(total=total_records, desc="extract-features", unit="rec", dynamic_ncols=True)
    pending: list[tuple[TokenRecord, FeatureWriter]] = []

    def written() -> int:
        return sum(w.tokens for w in writers.values())

    def run_pending() -> None:
        pending.sort(key=lambda item: len(item[0].input_ids))
        while pending:
            # A batch of similar lengths whose padded size fits the token budget.
            size = 1
            while size < len(pending) and len(pending[size][0].input_ids) * (size + 1) <= batch_tokens:
                size += 1
            batch, pending[:] = pending[:size], pending[size:]
            with autocast(device, bf16):
                outputs = run_target(model, [r.input_ids for r, _ in batch], layer_ids, topk)
            for (record, writer), (context, labels) in zip(batch, outputs):
                writer.add(record, context, labels)
                stats.sequences += 1
                stats.tokens += len(record.input_ids)
                stats.response_tokens += len(record.input_ids) - record.response_start
            bar.update(len(batch))
            bar.set_postfix(tokens=stats.tokens, tok_s=f"{stats.tokens / (time.perf_counter() - start):.0f}")

    vocab = fingerprint["vocab_size"]
    for record in iter_records(data, max_seq_len):
        if max_tokens is not None and written() >= max_tokens:
            break
        split = "heldout" if heldout_score(record.id) < heldout_frac else "train"
        writer = writers[split]
        if record.id in writer.done_ids:
            stats.skipped_done += 1
            bar.update(1)
            continue
        check_vocabulary(record, vocab, data)
        writer.done_ids.add(record.id)  # duplicates of an id later in the file are skipped
        pending.append((record, writer))
        if sum(len(r.input_ids) for r, _ in pending) >= 8 * batch_tokens:
            run_pending()
    run_pending()
    for writer in writers.values():
        writer.flush()
    bar.close()
    stats.seconds = time.perf_counter() - start
    if not any(read_index(w.out_dir) for w in writers.values()):
        raise FeatureError(f"no usable records in {data} (need prompt and response token ids)")
    return stats


# ------------------------------------------------------------------ CLI
def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        stats = extract_features(
            args.target,
            args.data,
            args.out,
            layer_ids=args.layers,
            heldout_dir=args.heldout_out,
            heldout_frac=args.heldout_frac,
            max_seq_len=args.max_seq_len,
            max_tokens=args.max_tokens,
            batch_tokens=args.batch_tokens,
            shard_tokens=args.shard_tokens,
            topk=args.soft_label_topk,
            precision=args.precision,
        )
    except (FeatureError, ConfigError, DeviceError, OSError) as exc:
        print(f"extract-features: {exc}", file=sys.stderr)
        return 1
    print(
        f"extract-features: {stats.sequences} new sequences, {stats.tokens} tokens "
        f"({stats.response_tokens} response tokens) in {stats.seconds:.0f} s; "
        f"{stats.skipped_done} were already done"
    )
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract-features", help="run the target once and cache drafter training features (bf16 shards)"
    )
    parser.add_argument("--target", type=Path, required=True, help="HF target checkpoint directory")
    parser.add_argument("--data", type=Path, required=True, help="generate-data JSONL file")
    parser.add_argument("--out", type=Path, required=True, help="feature directory (created or resumed)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="target layer ids (default: init-drafter's spread over the depth)")
    parser.add_argument("--heldout-out", type=Path, default=None,
                        help="feature directory for the held-out split (calibration)")
    parser.add_argument("--heldout-frac", type=float, default=0.0,
                        help="share of records (by id hash) that go to --heldout-out")
    parser.add_argument("--max-seq-len", type=positive_int, default=2048)
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="stop once this many tokens are stored (both splits)")
    parser.add_argument("--batch-tokens", type=positive_int, default=2048,
                        help="padded tokens per target forward pass")
    parser.add_argument("--shard-tokens", type=positive_int, default=32768,
                        help="tokens per shard file (bounds memory)")
    parser.add_argument("--soft-label-topk", type=positive_int, default=DEFAULT_TOPK,
                        help="target probabilities kept per position (the TV loss's error is at most "
                             "twice the mass left out; `benchmarks/train_throughput.py` reports it)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto (default): fp32 on the cpu; bf16 runs the target under bf16 autocast, on "
                             "cpus with native bf16 products (avx512_bf16 or amx_bf16) about 1.85x faster")
    parser.set_defaults(func=_run)
