"""Where a training process runs: its device, its process group under torchrun, and the
loss denominators that make data-parallel gradients exact.

Without a GPU nothing changes from a plain CPU run: fp32 (bf16 autocast with
`--precision bf16` on CPUs that multiply bf16 natively), gloo between ranks. With
`--device cuda` (or `auto` where every rank on the node can have a GPU of its own) rank r
drives GPU LOCAL_RANK, ranks talk over NCCL, and the forward pass runs under bf16
autocast; master weights, optimizer state and the loss reductions stay fp32.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """The requested device cannot be used; the message says what this machine has."""


def local_ranks() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) for a plain process."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def select_device(requested: str) -> torch.device:
    """The device this rank trains on. `auto` takes CUDA only when each local rank gets its
    own GPU, so the same command falls back to CPU on a machine without one (or with too
    few) instead of putting two ranks on one GPU."""
    if requested not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    local_rank, local_world = local_ranks()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        requested = "cuda" if gpus >= local_world else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if gpus == 0:
        raise DeviceError(
            f"--device cuda: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    if gpus < local_world:
        raise DeviceError(
            f"--device cuda: {local_world} ranks on this node but {gpus} visible CUDA device(s); "
            f"start at most {gpus} (torchrun --nproc-per-node {gpus})"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); under torchrun starts the process group: NCCL between GPUs,
    gloo between CPU processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


PRECISIONS = ("auto", "fp32", "bf16")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it bf16
    matrix products are emulated and slower than fp32."""
    try:
        flags = open("/proc/cpuinfo", encoding="ascii", errors="replace").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def uses_bf16(device: torch.device, precision: str) -> bool:
    """`auto`: bf16 on CUDA, fp32 on the CPU (bit-for-bit comparable with earlier CPU runs);
    `bf16` on a CPU needs native bf16 products (where this machine has them, a drafter's
    step runs about twice as fast: `benchmarks/train_throughput.py`)."""
    if precision not in PRECISIONS:
        raise DeviceError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return device.type == "cuda"
    if precision == "bf16" and device.type == "cpu" and not cpu_has_bf16_matmul():
        raise DeviceError("--precision bf16 on this CPU: it has no native bf16 products (avx512_bf16 or amx_bf16); "
                          "use fp32")
    return precision == "bf16"


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """The forward pass under bf16 autocast, or as it is (fp32). Master weights, optimizer
    state and the loss reductions stay fp32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def data_parallel_denominator(local: torch.Tensor) -> torch.Tensor:
    """The denominator that turns DDP's averaged gradient into that of the global mean.

    A loss term is a weighted sum S_r over rank r's positions divided by a denominator.
    DDP averages gradients over the W ranks, so with D = (sum over ranks of `local`) / W
    every rank computes S_r / D and the step follows (1/W) sum_r grad S_r / D =
    grad (sum_r S_r / sum_r local_r): the mean over all ranks' positions, whatever each
    rank holds. Each rank dividing by its own `local` would instead weigh a position on a
    rank with few positions more than one on a rank with many. The rank losses averaged
    over ranks are the global mean too. Without a process group of several ranks, `local`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()
