"""The DSpark drafter as a plain PyTorch module, in the public checkpoint format.

Block layout. vLLM's V1 runner feeds a parallel drafter the anchor (bonus) token followed
by K mask tokens. Slot k (0-based) of that block predicts the token at anchor position
k + 1 (DSpark's "anchor-first" reading), so K draft tokens come from slots 0..K-1 and the
last mask slot only takes part in the bidirectional block attention. Training uses the
same K + 1 slots with K = block_size; serving drafts d < K positions with d + 1 slots, which
measured within 0.01 of the full block's first-draft survival (README, "Block layout").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_dspark.config import ConfigError, DrafterConfig
from vllm_dspark.model.heads import ConfidenceHead, DraftOutput, build_markov_head, sequential_draft
from vllm_dspark.model.layers import DraftDecoderLayer, RMSNorm

WEIGHTS_FILE = "model.safetensors"
# Weights a checkpoint may leave out: they are the target's own (a reduced-vocabulary
# drafter stores its LM head, a slice of the target's, since vLLM loads it so).
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
D2T = "d2t"  # draft id -> target id offset, vLLM's name


def shared_with_target(config: DrafterConfig) -> tuple[str, ...]:
    return ("embed_tokens.weight",) if config.reduced_vocab else SHARED_WITH_TARGET


def target_ids_of(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Absolute target ids of the draft vocabulary; raises if one falls outside it."""
    ids = torch.arange(len(d2t), device=d2t.device) + d2t.long()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ConfigError(f"d2t maps draft ids outside the target vocabulary (0..{vocab_size - 1})")
    if len(torch.unique(ids)) != len(ids):
        raise ConfigError("d2t maps two draft ids to the same target id")
    return ids


def block_mask(anchor_positions: torch.Tensor, context_len: int, slots: int) -> torch.Tensor:
    """Attention mask [B, A*slots, T + A*slots]: a block sees context positions strictly
    before its anchor and every slot of its own block, nothing else."""
    b, a = anchor_positions.shape
    device = anchor_positions.device
    ctx_visible = torch.arange(context_len, device=device).view(1, 1, -1) < anchor_positions.unsqueeze(-1)
    ctx_visible = ctx_visible.unsqueeze(2).expand(b, a, slots, context_len).reshape(b, a * slots, context_len)
    block_id = torch.arange(a, device=device).repeat_interleave(slots)
    same_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(b, -1, -1)
    return torch.cat([ctx_visible, same_block], dim=-1)


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.lm_head = nn.Linear(d, config.draft_vocab, bias=False)
        if config.reduced_vocab:
            self.register_buffer(D2T, torch.zeros(config.draft_vocab, dtype=torch.int64))
        for frozen in (self.embed_tokens, self.lm_head):
            frozen.weight.requires_grad_(False)
        self.fc = nn.Linear(config.context_hidden_size * len(config.target_layer_ids), d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.markov_head = build_markov_head(config)
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None

    # ----------------------------------------------------------------- backbone
    def block_input_ids(self, anchors: torch.Tensor, num_draft: int) -> torch.Tensor:
        """[..., ] anchors -> [..., num_draft + 1] = anchor followed by mask tokens."""
        masks = torch.full(
            (*anchors.shape, num_draft), self.config.mask_token_id, dtype=torch.long, device=anchors.device
        )
        return torch.cat([anchors.unsqueeze(-1).long(), masks], dim=-1)

    def backbone(
        self,
        context_states: torch.Tensor,
        block_input_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
    ) -> torch.Tensor:
        """One parallel pass for many blocks.

        context_states: [B, T, m * d_target] concatenated target hidden states at
        positions 0..T-1; block_input_ids: [B, A, S]; anchor_positions: [B, A].
        Returns the final-normed block hidden states [B, A, S, d].
        """
        b, a, s = block_input_ids.shape
        t = context_states.shape[1]
        ctx = self.hidden_norm(self.fc(context_states))
        ctx_positions = torch.arange(t, device=ctx.device).expand(b, t)
        positions = (anchor_positions.unsqueeze(-1) + torch.arange(s, device=ctx.device)).reshape(b, a * s)
        mask = block_mask(anchor_positions, t, s)
        x = self.embed_tokens(block_input_ids).reshape(b, a * s, -1)
        for layer in self.layers:
            ctx_kv = layer.self_attn.keys_values(ctx, ctx_positions)
            x = layer(x, positions, ctx_kv, mask)
        return self.norm(x).view(b, a, s, -1)

    # --------------------------------------------------------- sequential stage
    def confidence_temperatures(self, num_positions: int, like: torch.Tensor) -> torch.Tensor:
        temps = self.config.confidence_temperatures or [1.0] * self.config.block_size
        return like.new_tensor(temps[:num_positions])

    def teacher_forced_heads(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training/evaluation view: logits [N, K, V_draft] over the drafter's own vocabulary
        (`target_to_draft` maps target ids into it) and raw confidence logits [N, K] given
        the true previous tokens [N, K] (prev_tokens[:, 0] is the anchor). Never widened to
        the target vocabulary: that would cost a 49K-wide softmax per position for columns
        that are -inf anyway."""
        n, k, _ = hidden.shape
        logits = self.lm_head(hidden)
        state = self.markov_head.initial_state(n, hidden) if self.markov_head else None
        biases, conf_logits = [], []
        for j in range(k):
            feature = None
            if self.markov_head is not None:
                bias, feature, state = self.markov_head.step(prev_tokens[:, j], hidden[:, j], state)
                biases.append(bias)
            if self.confidence_head is not None:
                conf_logits.append(self.confidence_head.logit(hidden[:, j], feature))
        if biases:
            logits = logits + torch.stack(biases, dim=1)
        return logits, torch.stack(conf_logits, dim=1) if conf_logits else None

    def draft_to_target(self) -> torch.Tensor | None:
        """Target id of each draft id (None for a full-vocabulary drafter; `d2t` is checked
        when the checkpoint is loaded)."""
        if not self.config.reduced_vocab:
            return None
        d2t = getattr(self, D2T)
        return torch.arange(len(d2t), device=d2t.device) + d2t

    def target_to_draft(self) -> torch.Tensor | None:
        """[V_target] draft id of each target id, -1 outside the subset (None for a
        full-vocabulary drafter)."""
        draft_ids = self.draft_to_target()
        if draft_ids is None:
            return None
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
        index[draft_ids] = torch.arange(len(draft_ids), device=draft_ids.device)
        return index

    def draft(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftOutput:
        """Sequential stage after the backbone; hidden: [N, K, d] of slots 0..K-1. Sampler
        seeds are drawn from `generator`, so a seeded generator reproduces the draft."""
        return sequential_draft(
            self.markov_head,
            self.confidence_head,
            self.confidence_temperatures(hidden.shape[1], hidden),
            self.lm_head(hidden),
            hidden,
            anchors,
            temperature,
            generator=generator,
            draft_to_target=self.draft_to_target(),
            target_vocab=self.config.vocab_size,
        )

    # ------------------------------------------------------------------ I/O
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything except the weights shared with (copied from) the target."""
        shared = shared_with_target(self.config)
        return {k: v for k, v in self.state_dict().items() if k not in shared}

    def save_pretrained(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(out)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.trainable_state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})

    def load_shared_from_target(self, target_dir: str | Path) -> None:
        embed, lm_head = read_target_embeddings(target_dir, self.config)
        self.embed_tokens.weight.data.copy_(embed)
        if not self.config.reduced_vocab:
            self.lm_head.weight.data.copy_(lm_head)

    @classmethod
    def from_pretrained(
        cls, drafter_dir: str | Path, target_dir: str | Path | None = None
    ) -> "DSparkDrafter":
        """Load a drafter; embedding and LM head come from the checkpoint when present,
        otherwise from `target_dir` (required then)."""
        config = DrafterConfig.from_dir(drafter_dir)
        weights_path = Path(drafter_dir) / WEIGHTS_FILE
        if not weights_path.is_file():
            raise ConfigError(f"drafter weights not found: {weights_path}")
        state = load_file(str(weights_path))
        model = cls(config)
        missing_shared = [k for k in shared_with_target(config) if k not in state]
        if missing_shared:
            if target_dir is None:
                raise ConfigError(
                    f"{drafter_dir} does not store {missing_shared}; pass the target "
                    "checkpoint so they can be shared from it"
                )
            model.load_shared_from_target(target_dir)
        expected = set(model.state_dict())
        unexpected = sorted(set(state) - expected)
        missing = sorted(expected - set(state) - set(missing_shared))
        if unexpected or missing:
            raise ConfigError(
                f"drafter weights in {weights_path} do not match its config: "
                f"missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        shapes = model.state_dict()
        wrong = [f"{k}: {tuple(v.shape)} vs {tuple(shapes[k].shape)}" for k, v in state.items() if v.shape != shapes[k].shape]
        if wrong:
            raise ConfigError(f"drafter weight shapes do not match its config: {wrong[:8]}")
        model.load_state_dict(state, strict=False)
        if config.reduced_vocab:
            target_ids_of(getattr(model, D2T), config.vocab_size)  # a clear error for a bad d2t
        return model


def read_target_config(target_dir: str | Path) -> dict:
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"target config not found: {path}")
    return json.loads(path.read_text())


def check_drafter_fits_target(config: DrafterConfig, target_dir: str | Path) -> dict:
    """Validate against a Hugging Face target checkpoint; returns the target's config."""
    target = read_target_config(target_dir)
    config.check_fits_target(
        hidden_size=target["hidden_size"],
        vocab_size=target["vocab_size"],
        num_layers=target["num_hidden_layers"],
    )
    return target


def read_target_embeddings(
    target_dir: str | Path, config: DrafterConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head, read lazily from its safetensors."""
    target = check_drafter_fits_target(config, target_dir)
    tensors: dict[str, torch.Tensor] = {}
    wanted = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}
    files = sorted(Path(target_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no safetensors files in target checkpoint {target_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name in wanted:
                    tensors[wanted[name]] = handle.get_tensor(name).float()
    if "embed" not in tensors:
        raise ConfigError(f"target checkpoint {target_dir} has no model.embed_tokens.weight")
    if "lm_head" not in tensors:
        if not target.get("tie_word_embeddings", False):
            raise ConfigError(f"target checkpoint {target_dir} has no lm_head.weight")
        tensors["lm_head"] = tensors["embed"]
    return tensors["embed"], tensors["lm_head"]
