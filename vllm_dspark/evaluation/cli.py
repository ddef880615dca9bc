"""`vllm-dspark eval`: offline accepted length of a drafter on a `turns` JSONL dataset."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run(args: argparse.Namespace) -> int:
    import torch

    from vllm_dspark.evaluation.evaluator import EvalSettings, evaluate

    torch.set_num_threads(args.threads)
    settings = EvalSettings(
        target=args.target,
        drafter=args.drafter,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        block_size=args.block_size,
        seed=args.seed,
    )
    try:
        for out in filter(None, (args.json, args.trace)):
            out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.trace, "w") if args.trace else contextlib.nullcontext() as trace:
            result = evaluate(settings, trace=trace)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"eval: error: {exc}", file=sys.stderr)
        return 1
    err = result["tau_stderr"]
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in result["acceptance_by_position"])
    print(
        f"tau {result['tau']:.3f}" + ("" if err is None else f" ± {err:.3f}")
        + f" over {result['rounds']} rounds, {result['tokens_generated']} tokens; "
        f"acceptance by position: {rates}; wrote {args.json}"
    )
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="offline accepted length (tau) of a drafter: chain speculative decoding in PyTorch"
    )
    parser.add_argument("--target", type=Path, required=True, help="Hugging Face target checkpoint directory")
    parser.add_argument("--drafter", type=Path, required=True, help="drafter checkpoint directory")
    parser.add_argument("--dataset", type=Path, required=True, help="JSONL prompts with a 'turns' list")
    parser.add_argument("--num-prompts", type=_positive_int, default=None, help="first N prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per turn")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy verification")
    parser.add_argument("--block-size", type=_positive_int, default=None,
                        help="verification length K (default: the drafter's block size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine two threads "
                        "spin on each other and run 10-50x slower; run datasets in parallel instead)")
    parser.add_argument("--json", type=Path, required=True, help="result file")
    parser.add_argument("--trace", type=Path, default=None,
                        help="JSONL, one line per round: confidences and accepted count")
    parser.set_defaults(func=_run)
