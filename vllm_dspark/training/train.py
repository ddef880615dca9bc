"""`vllm-dspark train`: one readable training loop for DSpark / DFlash drafters.

Per step each process takes `--batch-seqs` sequences of its own shard, samples
`--anchors-per-seq` blocks in each, runs one packed backbone pass plus the teacher-forced
sequential heads and minimises 0.1 CE + 0.9 TV + 1.0 confidence BCE (losses.py) with AdamW,
linear warm-up, cosine decay and grad-norm clipping. The target is frozen and so are the
drafter's embedding and LM head (shared with the target).

Device (distributed.py): `--device auto` trains on the GPUs when every rank has one (bf16
autocast, NCCL between ranks), else on the CPU in fp32 (gloo between ranks; `--precision
bf16` autocasts there too, on CPUs with native bf16 products).

Data-parallel: under `torchrun` every rank reads a different shard of the sequences and
DistributedDataParallel averages the gradients, so all replicas stay equal (checked at
every checkpoint through a weight digest). Each loss is divided by the supervision weight
of all ranks together, so the step is that of one process holding every rank's batch.

Determinism: the sequences and anchors of step s depend only on (seed, rank, s), so a run
resumed from a checkpoint on the same device continues exactly as the uninterrupted run
would have.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from vllm_dspark.cli import positive_int
from vllm_dspark.config import ConfigError
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.init_drafter import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MARKOV_RANK,
    DEFAULT_NUM_LAYERS,
    drafter_config_for_target,
    init_weights,
)
from vllm_dspark.training.blocks import DrafterLoss, pack_batch, usable_sequences
from vllm_dspark.training.calibrate import collect_confidences
from vllm_dspark.training.distributed import (
    DEVICES,
    PRECISIONS,
    DeviceError,
    autocast,
    init_distributed,
    select_device,
    uses_bf16,
)
from vllm_dspark.training.features import (
    FeatureError,
    FeatureSource,
    FeatureStore,
    OnTheFlyFeatures,
    check_same_target,
    check_source_fits,
    open_features,
)

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
HELDOUT_LOG = "heldout_log.jsonl"
BEST_DIR = "best"
LOGGED = ("total", "ce", "tv", "conf")
# Options that build a new drafter; unset ones take init_drafter's defaults.
DRAFTER_OPTIONS = ("num_layers", "block_size", "markov_rank", "markov_head_type")


@dataclass(frozen=True)
class RunSettings:
    """What a resumed run must share with the run that wrote the checkpoint."""

    steps: int
    lr: float
    min_lr_frac: float
    warmup_frac: float
    weight_decay: float
    grad_clip: float
    batch_seqs: int
    anchors_per_seq: int
    seed: int
    world_size: int
    bf16: bool


def lr_at(step: int, settings: RunSettings) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr_frac * lr` at the last step."""
    warmup = max(1, math.ceil(settings.warmup_frac * settings.steps))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    floor = settings.min_lr_frac * settings.lr
    return floor + 0.5 * (settings.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A generator that depends only on (seed, rank, step): resumable, rank-distinct."""
    key = hashlib.sha256(f"{seed}/{rank}/{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:7], "big"))


class EpochSampler:
    """Sequence indices per step: epoch-wise permutations of this rank's shard, so every
    sequence is seen once per epoch; a pure function of (seed, rank, step)."""

    def __init__(self, indices: list[int], batch: int, seed: int, rank: int) -> None:
        self.indices, self.batch, self.seed, self.rank = indices, batch, seed, rank
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = torch.randperm(len(self.indices), generator=step_generator(self.seed, self.rank, -1 - epoch))
            # Keep two epochs: a batch may straddle an epoch boundary.
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = [self.indices[i] for i in order]
        return self._perms[epoch]

    def batch_at(self, step: int) -> list[int]:
        n = len(self.indices)
        return [self._perm(i // n)[i % n] for i in range(step * self.batch, (step + 1) * self.batch)]


# ------------------------------------------------------------------ set-up helpers
def given_drafter_options(args: argparse.Namespace) -> dict[str, Any]:
    """The drafter options given on the command line."""
    return {name: getattr(args, name) for name in DRAFTER_OPTIONS if getattr(args, name) is not None}


def build_drafter(args: argparse.Namespace, layer_ids: list[int] | None) -> DSparkDrafter:
    """From --init (a drafter directory) or from the drafter options, seeded."""
    if args.init is not None:
        return DSparkDrafter.from_pretrained(args.init, args.target)
    config = drafter_config_for_target(args.target, target_layer_ids=layer_ids, **given_drafter_options(args))
    drafter = DSparkDrafter(config)
    init_weights(drafter, args.seed)
    drafter.load_shared_from_target(args.target)
    return drafter


def weights_digest(drafter: DSparkDrafter) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(drafter.trainable_state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save_checkpoint(out: Path, drafter: DSparkDrafter, optimizer: torch.optim.Optimizer, step: int, settings: RunSettings) -> None:
    """Drafter directory + optimizer state, written beside and then swapped in."""
    final, tmp = out / CHECKPOINT_DIR, out / (CHECKPOINT_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "settings": asdict(settings)}, tmp / TRAINER_STATE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def save_final(drafter: DSparkDrafter, out: Path, dtype: str) -> None:
    """The trained drafter; bfloat16 halves its size (loaders cast to their own dtype),
    while checkpoints stay float32 so that a resumed run continues exactly."""
    drafter.to(getattr(torch, dtype))
    drafter.config.torch_dtype = dtype
    drafter.save_pretrained(out)


def heldout_survival(drafter: DSparkDrafter, store: FeatureStore, anchors_per_seq: int) -> dict[str, Any]:
    """Teacher-forced prefix survival per block position on held-out sequences (the mean of
    prod_{j<=k} exact acceptance probability) and the accepted length it implies,
    tau = 1 + sum_k survival_k: what the kept checkpoint is chosen by, since training loss
    keeps falling on the training split when held-out acceptance no longer rises."""
    was_training = drafter.training
    _, accept = collect_confidences(drafter, store, anchors_per_seq)
    drafter.train(was_training)
    survival = torch.cumprod(accept, dim=1).mean(0)
    return {"survival": [round(float(x), 4) for x in survival], "tau": round(1.0 + float(survival.sum()), 4),
            "blocks": len(accept)}


def save_best(out: Path) -> None:
    """Copy the checkpoint just written to OUT/best (beside, then swapped in)."""
    final, tmp = out / BEST_DIR, out / (BEST_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out / CHECKPOINT_DIR, tmp, ignore=shutil.ignore_patterns(TRAINER_STATE))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out evaluation with the longest accepted length (the earliest on ties)."""
    return max(rows, key=lambda r: (r["tau"], -r["step"]), default=None)


def load_checkpoint(out: Path, target: Path, settings: RunSettings) -> tuple[DSparkDrafter, dict[str, Any]]:
    ckpt = out / CHECKPOINT_DIR
    if not (ckpt / TRAINER_STATE).is_file():
        raise FeatureError(f"--resume: no checkpoint in {ckpt}")
    # On the CPU: the optimizer moves its state to wherever the parameters are.
    state = torch.load(ckpt / TRAINER_STATE, weights_only=True, map_location="cpu")
    changed = {k: (v, getattr(settings, k)) for k, v in state["settings"].items() if getattr(settings, k) != v}
    if changed:
        raise FeatureError(f"--resume with different settings (checkpoint, now): {changed}")
    return DSparkDrafter.from_pretrained(ckpt, target), state


# ------------------------------------------------------------------ the loop
def train(args: argparse.Namespace) -> dict[str, Any]:
    device = select_device(args.device)
    bf16 = uses_bf16(device, args.precision)
    rank, world = init_distributed(device)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    settings = RunSettings(
        steps=args.steps, lr=args.lr, min_lr_frac=args.min_lr_frac, warmup_frac=args.warmup_frac,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, batch_seqs=args.batch_seqs,
        anchors_per_seq=args.anchors_per_seq, seed=args.seed, world_size=world, bf16=bf16,
    )
    # Cached features fix the layers a new drafter reads; check them before building it.
    features_where = " + ".join(str(d) for d in args.features or [])
    store = open_features(args.features) if args.features is not None else None
    if store is not None:
        check_same_target(store, args.target, features_where)
    heldout = FeatureStore(args.heldout) if args.heldout is not None else None
    if heldout is not None:
        check_same_target(heldout, args.target, str(args.heldout))
    start_step, state = 0, None
    if args.resume:
        drafter, state = load_checkpoint(out, args.target, settings)
        start_step = state["step"]
    else:
        drafter = build_drafter(args, store.layer_ids if store is not None else None)
    drafter.to(device)
    config = drafter.config
    config.num_anchors = args.anchors_per_seq  # recorded in config.json (training only)
    source: FeatureSource = store or OnTheFlyFeatures(
        args.target, args.data, config.target_layer_ids, args.max_seq_len, args.heldout_frac, device
    )
    check_source_fits(source, config, args.target, features_where or str(args.data))
    if heldout is not None:
        check_source_fits(heldout, config, args.target, str(args.heldout))

    usable = usable_sequences(source, config.block_size)
    if not usable:
        raise FeatureError(f"no sequence has a response of more than block_size={config.block_size} tokens")
    shard = usable[rank::world]
    if not shard:
        raise FeatureError(f"rank {rank} has no sequences: {len(usable)} usable sequences for {world} ranks")
    sampler = EpochSampler(shard, args.batch_seqs, args.seed, rank)

    model = DrafterLoss(drafter)
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids) if world > 1 else model
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])

    is_main = rank == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        num_params = sum(p.numel() for p in params)
        logger.info(
            "training %s on %s (%s): %d trainable parameters, %d usable sequences (%d on this rank), world %d, steps %d..%d",
            config.architectures[0], device.type, "bf16 autocast" if bf16 else "fp32", num_params, len(usable), len(shard),
            world, start_step, args.steps,
        )
    if is_main:  # rows of steps after the checkpoint (or of an earlier run) go
        truncate_log(out / LOG_FILE, start_step)
        truncate_log(out / HELDOUT_LOG, start_step)
    evaluations = read_log(out / HELDOUT_LOG) if is_main else []
    if is_main and heldout is not None and start_step and (best := best_row(evaluations)) and best["step"] == start_step:
        save_best(out)  # the run may have stopped between its checkpoint and best/
    log_file = open(out / LOG_FILE, "a", encoding="utf-8") if is_main else None
    bar = tqdm(total=args.steps, initial=start_step, desc="train", disable=not is_main, dynamic_ncols=True)
    recent: list[dict[str, float]] = []
    total_anchors, train_seconds = 0, 0.0
    stop = min(args.steps, args.stop_at or args.steps)
    if stop <= start_step:
        raise FeatureError(f"--stop-at {args.stop_at}: the checkpoint is already at step {start_step}")
    for step in range(start_step, stop):
        t0 = time.perf_counter()
        generator = step_generator(args.seed, rank, step)
        batch = pack_batch([source.get(i) for i in sampler.batch_at(step)], args.anchors_per_seq, config.block_size, generator)
        batch = batch.to(device)
        lr = lr_at(step, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast(device, bf16):
            losses = wrapped(batch)
        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()

        anchors, row = step_stats(batch.num_blocks, losses, world)
        seconds = time.perf_counter() - t0
        total_anchors += anchors
        train_seconds += seconds
        recent = (recent + [row])[-20:]
        if is_main:
            mean = {k: sum(r[k] for r in recent) / len(recent) for k in row}
            bar.set_postfix(
                loss=f"{mean['total']:.3f}", ce=f"{mean['ce']:.2f}", tv=f"{mean['tv']:.3f}",
                conf=f"{mean['conf']:.3f}", lr=f"{lr:.1e}", anc_s=f"{total_anchors / train_seconds:.1f}",
            )
            bar.update(1)
            log_file.write(json.dumps({"step": step + 1, "lr": lr, "grad_norm": float(grad_norm), **row,
                                       "anchors": anchors, "seconds": round(seconds, 3)}) + "\n")
            log_file.flush()
        last = step + 1 == stop
        if last or (args.save_every and (step + 1) % args.save_every == 0):
            check_replicas_equal(drafter, rank, world)
            if is_main:
                save_checkpoint(out, drafter, optimizer, step + 1, settings)
                if heldout is not None:
                    evaluate_checkpoint(drafter, heldout, step + 1, args.heldout_anchors, out, evaluations)
            if world > 1:
                dist.barrier()
    bar.close()
    digest = weights_digest(drafter)  # of the trained fp32 weights, as checked across ranks
    best = best_row(evaluations)
    if is_main and stop < args.steps:
        logger.info("stopped at step %d of %d; continue with --resume", stop, args.steps)
        log_file.close()
    elif is_main:
        if best is not None:  # keep the checkpoint held-out acceptance prefers
            drafter = DSparkDrafter.from_pretrained(out / BEST_DIR, args.target)
            logger.info("keeping step %d: held-out tau %.3f (last step: %.3f)", best["step"], best["tau"], evaluations[-1]["tau"])
        save_final(drafter, out, args.save_dtype)
        log_file.close()
    summary = {
        "device": device.type,
        "precision": "bf16" if bf16 else "fp32",
        "steps": args.steps,
        "resumed_from": start_step,
        "stopped_at": stop,
        "anchors": total_anchors,
        "train_seconds": round(train_seconds, 1),
        "anchors_per_s": round(total_anchors / train_seconds, 2) if train_seconds else 0.0,
        "final": {k: round(sum(r[k] for r in recent) / len(recent), 4) for k in recent[0]} if recent else {},
        "digest": digest,
        "kept_step": (best["step"] if best is not None else args.steps) if stop == args.steps else None,
        "heldout": best,
    }
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def step_stats(num_blocks: int, losses: dict[str, torch.Tensor], world: int) -> tuple[int, dict[str, float]]:
    """Blocks of this step over all ranks, the loss terms averaged over ranks (each rank's
    is its share of the global mean, see `data_parallel_denominator`, so this average is
    that mean) and the mean acceptance label over all ranks' positions."""
    accept = losses["accept"].detach().float()
    values = torch.stack([accept.new_tensor(float(num_blocks)), accept.sum(), accept.new_tensor(float(accept.numel())),
                          *(losses[k].detach().float() for k in LOGGED)])
    if world > 1:
        dist.all_reduce(values)
    blocks, accept_sum, positions, *terms = values.tolist()
    return int(blocks), {**{k: v / world for k, v in zip(LOGGED, terms)}, "accept": accept_sum / positions}


def evaluate_checkpoint(drafter: DSparkDrafter, heldout: FeatureStore, step: int, anchors: int, out: Path,
                        evaluations: list[dict[str, Any]]) -> None:
    """Held-out survival of the checkpoint just saved, appended to `evaluations` and the
    log; best/ follows the best one."""
    row = {"step": step, **heldout_survival(drafter, heldout, anchors)}
    previous = best_row(evaluations)
    evaluations.append(row)
    with open(out / HELDOUT_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    if previous is None or row["tau"] > previous["tau"]:
        save_best(out)
    logger.info("step %d: held-out survival %s, tau %.3f", step, row["survival"], row["tau"])


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def truncate_log(path: Path, step: int) -> None:
    """Drop log rows written after the checkpoint a run resumes from."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(row + "\n" for row in rows))


def check_replicas_equal(drafter: DSparkDrafter, rank: int, world: int) -> None:
    """DDP keeps replicas equal; verify before saving, since a silent drift would make the
    saved weights (rank 0's) differ from what the other ranks trained."""
    digest = weights_digest(drafter)
    # The whole line in one write: print() writes text and newline separately, and on a
    # pipe shared by all ranks another rank's line can land between the two.
    sys.stderr.write(f"rank {rank}/{world}: weights digest {digest}\n")
    sys.stderr.flush()
    if world > 1:
        digests: list[str] = [""] * world
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"data-parallel replicas diverged: weight digests {digests}")


# ------------------------------------------------------------------ CLI
def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.init is not None and given_drafter_options(args):
        print("train: give either --init or drafter options (--num-layers ...), not both", file=sys.stderr)
        return 2
    try:
        summary = train(args)
    except (FeatureError, ConfigError, DeviceError, OSError) as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print("train: " + json.dumps(summary))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a DSpark/DFlash drafter (also under torchrun)")
    parser.add_argument("--target", type=Path, required=True, help="HF target checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--features", type=Path, nargs="+",
                        help="feature directories from extract-features (several are read as one set)")
    source.add_argument("--data", type=Path, help="generate-data JSONL: run the target on the fly instead")
    parser.add_argument("--max-seq-len", type=positive_int, default=2048, help="with --data")
    parser.add_argument("--heldout-frac", type=float, default=0.0,
                        help="with --data: leave out the records extract-features puts in a held-out split")
    parser.add_argument("--out", type=Path, required=True, help="output drafter directory (+ checkpoint/)")
    parser.add_argument("--init", type=Path, default=None, help="start from this drafter directory")
    parser.add_argument("--num-layers", type=positive_int, default=None,
                        help=f"new drafter (default {DEFAULT_NUM_LAYERS})")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help=f"new drafter (default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--markov-rank", type=int, default=None,
                        help=f"new drafter (default {DEFAULT_MARKOV_RANK}; 0 = DFlash)")
    parser.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"], default=None)
    parser.add_argument("--steps", type=positive_int, required=True)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor, as a share of --lr")
    parser.add_argument("--warmup-frac", type=float, default=0.04)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--batch-seqs", type=positive_int, default=4, help="sequences per step and rank")
    parser.add_argument("--anchors-per-seq", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto (default): cuda when every rank on this node has a GPU of its own, "
                        "else cpu; cuda trains under bf16 autocast with NCCL between ranks, cpu in fp32 with gloo")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto (default): bf16 autocast on cuda, fp32 on cpu; bf16 on a cpu needs native bf16 "
                        "products (avx512_bf16 or amx_bf16) and runs about twice as fast there")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint period in steps (0: end only)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument("--stop-at", type=positive_int, default=None,
                        help="end this invocation at this step, checkpoint saved, without writing the final drafter: "
                        "a schedule of --steps spread over several sessions continues with --resume")
    parser.add_argument("--heldout", type=Path, default=None,
                        help="held-out feature directory: teacher-forced survival per position at every checkpoint "
                        f"({HELDOUT_LOG}); the final drafter is the checkpoint with the longest held-out accepted length")
    parser.add_argument("--heldout-anchors", type=positive_int, default=16, help="blocks per held-out sequence")
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the final drafter weights")
    parser.set_defaults(func=_run)
