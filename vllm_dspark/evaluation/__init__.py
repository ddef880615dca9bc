"""Offline acceptance evaluation: chain speculative decoding of a drafter against its
target in plain PyTorch (no vLLM engine), so accepted lengths can be measured exactly and
reproducibly on any machine. `vllm-dspark eval` is the command-line entry point.

Modules: `verification` (the pure accept/reject functions), `target_runner` (cached target
forward that also yields the drafter's context states), `dataset` (`turns` JSONL),
`metrics` (tau and per-position statistics), `evaluator` (the decoding loop), `cli`.
Nothing is imported here, so `vllm-dspark --help` stays free of torch.
"""
