"""`vllm-dspark init-drafter`: write an untrained drafter that fits a target checkpoint."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from vllm_dspark.config import ConfigError, DrafterConfig, MarkovHeadType
from vllm_dspark.model.drafter import DSparkDrafter, check_drafter_fits_target, read_target_config

logger = logging.getLogger(__name__)

# Defaults of a new drafter, for init-drafter and train alike. DrafterConfig's own
# markov_rank default is the paper's 256; these CLIs have always used 64, and the committed
# drafters under examples/drafters/ were trained with 32 (their config.json says so).
DEFAULT_NUM_LAYERS = 2
DEFAULT_BLOCK_SIZE = 7
DEFAULT_MARKOV_RANK = 64
DEFAULT_MARKOV_HEAD_TYPE: MarkovHeadType = "vanilla"

# Tokens the chat template or the tokenizer uses in ordinary text; a mask token must not
# be one of them, or an anchor could look like a mask.
_COMMON_SPECIAL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<pad>"}


def spread_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """Layers spread over the depth, as in the paper's Qwen3-8B config (1, 9, 17, 25, 33
    of 36): from layer 1 to three layers before the end."""
    last = max(1, num_target_layers - 3)
    if num_target_layers <= count:
        return list(range(num_target_layers))
    step = (last - 1) / (count - 1)
    return sorted({round(1 + i * step) for i in range(count)})


def choose_mask_token_id(target_dir: Path, vocab_size: int) -> int:
    """A special token that plain text and the chat template never use; else the last id."""
    tokenizer_config = target_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        added = json.loads(tokenizer_config.read_text()).get("added_tokens_decoder", {})
        candidates = [
            int(token_id)
            for token_id, info in added.items()
            if info.get("special") and info.get("content") not in _COMMON_SPECIAL and int(token_id) < vocab_size
        ]
        if candidates:
            return max(candidates)
    return vocab_size - 1


def drafter_config_for_target(
    target_dir: str | Path,
    *,
    num_layers: int = DEFAULT_NUM_LAYERS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    markov_rank: int = DEFAULT_MARKOV_RANK,
    markov_head_type: MarkovHeadType = DEFAULT_MARKOV_HEAD_TYPE,
    target_layer_ids: list[int] | None = None,
) -> DrafterConfig:
    target = read_target_config(target_dir)
    if target.get("rope_scaling"):
        raise ConfigError(f"targets with rope_scaling are not supported yet ({target_dir})")
    heads = target["num_attention_heads"]
    config = DrafterConfig(
        hidden_size=target["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=target.get("num_key_value_heads", heads),
        head_dim=target.get("head_dim") or target["hidden_size"] // heads,
        intermediate_size=target["intermediate_size"],
        rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        rope_theta=target.get("rope_theta", 10000.0),
        max_position_embeddings=target.get("max_position_embeddings", 8192),
        vocab_size=target["vocab_size"],
        num_hidden_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids or spread_layer_ids(target["num_hidden_layers"]),
        mask_token_id=choose_mask_token_id(Path(target_dir), target["vocab_size"]),
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
    )
    check_drafter_fits_target(config, target_dir)
    return config


def init_weights(model: DSparkDrafter, seed: int) -> None:
    """Small random weights; the Markov output starts at zero so an untrained head adds
    nothing and training starts from a plain parallel drafter."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith("bias") or "markov_w2" in name:
            nn.init.zeros_(param)
        else:
            with torch.no_grad():
                param.normal_(0.0, 0.02, generator=generator)


# Per-layer tensors a draft layer takes from a target layer (Llama/Qwen names); q_norm and
# k_norm stay at one when the target has none (Llama).
_LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)
_OPTIONAL_LAYER_TENSORS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def warm_start_from_target(model: DSparkDrafter, target_dir: str | Path) -> list[int]:
    """Draft layers from the target's top decoder layers (draft layer i <- target layer
    L - n + i) and `fc` selecting the deepest captured layer's features (identity on its
    slice, zero elsewhere): the drafter starts as the target's last layers reading the
    target's own deep states. Returns the target layers used."""
    from safetensors import safe_open

    num_target = read_target_config(target_dir)["num_hidden_layers"]
    n = len(model.layers)
    sources = list(range(num_target - n, num_target))
    wanted = {f"model.layers.{src}.{name}": (i, name) for i, src in enumerate(sources) for name in _LAYER_TENSORS}
    found: set[str] = set()
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    i, name = wanted[key]
                    model.layers[i].get_parameter(name).data.copy_(handle.get_tensor(key))
                    found.add(name)
    missing = [name for name in _LAYER_TENSORS if name not in found and name not in _OPTIONAL_LAYER_TENSORS]
    if missing:
        raise ConfigError(f"warm start: target {target_dir} lacks decoder tensors {missing}")
    d = model.config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, -model.config.context_hidden_size :].copy_(torch.eye(d, model.config.context_hidden_size))
    return sources


def init_drafter(target_dir: str | Path, out_dir: str | Path, seed: int = 0, layers_from_target: bool = False,
                 **options) -> DSparkDrafter:
    config = drafter_config_for_target(target_dir, **options)
    model = DSparkDrafter(config)
    init_weights(model, seed)
    model.load_shared_from_target(target_dir)
    if layers_from_target:
        used = warm_start_from_target(model, target_dir)
        logger.info("draft layers start from target layers %s; fc selects target layer %d", used, config.target_layer_ids[-1])
    model.save_pretrained(out_dir)
    logger.info("wrote untrained drafter to %s: %s", out_dir, config.model_dump(exclude_none=True))
    return model


def _run(args: argparse.Namespace) -> int:
    options = dict(
        seed=args.seed,
        num_layers=args.num_layers,
        block_size=args.block_size,
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        target_layer_ids=args.target_layer_ids,
        layers_from_target=args.layers_from_target,
    )
    if args.draft_vocab_size is None:
        init_drafter(args.target, args.out, **options)
        print(f"untrained drafter written to {args.out}")
        return 0
    # Imported here: reduce_vocab reads corpora through training.features, which imports this module.
    from vllm_dspark.model.reduce_vocab import reduce_with_report

    if args.corpus is None:
        print("init-drafter: --draft-vocab-size needs --corpus (the target's own generations)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as full:
        init_drafter(args.target, full, **options)
        try:
            reduced = reduce_with_report(Path(full), Path(args.target), args.corpus, args.draft_vocab_size, Path(args.out))
        except (ConfigError, OSError, ValueError) as exc:
            print(f"init-drafter: {exc}", file=sys.stderr)
            return 1
    print(f"untrained drafter written to {args.out} (draft_vocab_size {reduced.draft_vocab})")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("init-drafter", help="write an untrained drafter for a target")
    parser.add_argument("--target", required=True, help="Hugging Face target checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--markov-rank", type=int, default=DEFAULT_MARKOV_RANK, help="0 gives a plain DFlash drafter")
    parser.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"], default=DEFAULT_MARKOV_HEAD_TYPE)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers-from-target", action="store_true",
                        help="warm start: draft layers copied from the target's top layers, fc selecting the "
                        "deepest captured layer (random init otherwise)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="a reduced draft vocabulary: the N tokens the target emits most often in --corpus")
    parser.add_argument("--corpus", type=Path, default=None, help="generate-data JSONL (or .jsonl.xz), with --draft-vocab-size")
    parser.set_defaults(func=_run)
