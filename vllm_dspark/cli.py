"""`vllm-dspark` console script: one subcommand per module that registers itself.

Each module in `COMMAND_MODULES` exposes `register_cli(subparsers)`, which adds its own
subparser and sets `func` (called with the parsed namespace, returns an exit code).
Modules are imported lazily so `vllm-dspark --help` does not import vLLM or torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES: tuple[str, ...] = (
    "vllm_dspark.serve",
    "vllm_dspark.model.init_drafter",
    "vllm_dspark.model.reduce_vocab",
    "vllm_dspark.engine_profile",
    "vllm_dspark.targets.cli",
    "vllm_dspark.training.data",
    "vllm_dspark.training.teacher_forced",
    "vllm_dspark.training.features",
    "vllm_dspark.training.train",
    "vllm_dspark.training.calibrate",
    "vllm_dspark.evaluation.cli",
)


def positive_int(value: str) -> int:
    """argparse type for counts that must be at least 1."""
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dspark",
        description="DSpark speculative decoding for vLLM: serving, drafters, tools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    # `serve` and `bench` forward everything to vLLM's own CLI untouched.
    if args_list[:1] in (["serve"], ["bench"]):
        from vllm_dspark.serve import run_vllm_cli

        return run_vllm_cli(args_list)
    args = build_parser().parse_args(args_list)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
