"""Anchors, packed blocks and the teacher-forced drafter pass shared by training and calibration.

An anchor at position p gives one block: inputs [x_p, mask x K], output slot k (0-based)
predicts x_{p+k+1}, against the target distribution p_t at position p+k. A block is only
used when all K predicted tokens lie in the response (the loss mask), so the drafter learns
from the target's own outputs and never from the prompt. Many blocks per sequence share
one context pass; the drafter's `block_mask` keeps each block to its own context prefix
(positions < p) and its own slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.training.distributed import data_parallel_denominator
from vllm_dspark.training.features import FeatureSource, SequenceFeatures
from vllm_dspark.training.losses import LossWeights, dspark_losses, supervision_weights
from vllm_dspark.training.soft_labels import TopKProbs


def valid_anchors(length: int, response_start: int, block_size: int) -> torch.Tensor:
    """Positions p whose K targets p+1..p+K all are response tokens inside the sequence."""
    first = max(response_start - 1, 0)
    last = length - 1 - block_size
    return torch.arange(first, last + 1) if last >= first else torch.zeros(0, dtype=torch.long)


def num_valid_anchors(length: int, response_start: int, block_size: int) -> int:
    return max(0, length - block_size - max(response_start - 1, 0))


def usable_sequences(source: FeatureSource, block_size: int) -> list[int]:
    """Indices of the sequences with at least one valid anchor."""
    return [i for i, (t, start) in enumerate(source.lengths()) if num_valid_anchors(t, start, block_size) > 0]


def choose_anchors(
    valid: torch.Tensor, count: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` distinct anchors (random if a generator is given, else evenly spread) and
    their weights; when fewer are valid, the rest repeat the first with weight 0."""
    if len(valid) == 0:
        raise ValueError("a sequence without valid anchors cannot form blocks")
    if len(valid) > count:
        if generator is None:
            picked = valid[torch.linspace(0, len(valid) - 1, count).round().long()]
        else:
            picked = valid[torch.randperm(len(valid), generator=generator)[:count]].sort().values
        return picked, torch.ones(count)
    pad = count - len(valid)
    anchors = torch.cat([valid, valid[:1].expand(pad)])
    return anchors, torch.cat([torch.ones(len(valid)), torch.zeros(pad)])


@dataclass
class BlockBatch:
    """B sequences, right-padded to T, with A anchors each."""

    input_ids: torch.Tensor  # [B, T]
    context: torch.Tensor  # [B, T, m*d]
    topk_ids: torch.Tensor  # [B, T, k] the target's soft labels (TopKProbs)
    topk_probs: torch.Tensor  # [B, T, k]
    anchors: torch.Tensor  # [B, A] positions
    anchor_weights: torch.Tensor  # [B, A], 0 = padding anchor

    @property
    def num_blocks(self) -> int:
        return int(self.anchor_weights.sum())

    def to(self, device: torch.device) -> BlockBatch:
        """Packed on the CPU (where features are read), then moved as a whole."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_batch(
    sequences: list[SequenceFeatures], anchors_per_seq: int, block_size: int, generator: torch.Generator | None
) -> BlockBatch:
    longest = max(len(s.input_ids) for s in sequences)
    b = len(sequences)
    input_ids = torch.zeros(b, longest, dtype=torch.long)
    context = torch.zeros(b, longest, sequences[0].context.shape[-1])
    k = min(s.soft_labels.k for s in sequences)
    topk_ids = torch.zeros(b, longest, k, dtype=torch.long)
    topk_probs = torch.zeros(b, longest, k)
    anchors, weights = [], []
    for row, seq in enumerate(sequences):
        t = len(seq.input_ids)
        input_ids[row, :t] = seq.input_ids
        context[row, :t] = seq.context
        topk_ids[row, :t] = seq.soft_labels.ids[:, :k]
        topk_probs[row, :t] = seq.soft_labels.probs[:, :k]
        picked, weight = choose_anchors(valid_anchors(t, seq.response_start, block_size), anchors_per_seq, generator)
        anchors.append(picked)
        weights.append(weight)
    return BlockBatch(input_ids, context, topk_ids, topk_probs, torch.stack(anchors), torch.stack(weights))


@dataclass
class TeacherForced:
    """Drafter outputs for the N real (non-padding) blocks of a batch."""

    logits: torch.Tensor  # [N, K, V_draft] over the drafter's own vocabulary
    conf_logits: torch.Tensor | None  # [N, K]
    target: TopKProbs  # [N, K, k] p_t at each predicted position, in draft ids
    targets: torch.Tensor  # [N, K] ground-truth next tokens, in draft ids (-1: outside)
    row_weights: torch.Tensor  # [N]


def teacher_forced_blocks(drafter: DSparkDrafter, batch: BlockBatch) -> TeacherForced:
    """One packed backbone pass, then the sequential heads fed the true previous tokens.
    Padding blocks are dropped before the vocabulary-sized work (the drafter's LM head),
    which dominates a step; the target's side is read from the stored top-k soft labels."""
    k = drafter.config.block_size
    b, a = batch.anchors.shape
    device = batch.anchors.device
    anchor_tokens = batch.input_ids.gather(1, batch.anchors)
    hidden = drafter.backbone(batch.context, drafter.block_input_ids(anchor_tokens, k), batch.anchors)
    keep = batch.anchor_weights.reshape(-1) > 0
    hidden = hidden[:, :, :k].reshape(b * a, k, -1)[keep]
    rows = torch.arange(b, device=device).repeat_interleave(a)[keep].unsqueeze(-1)  # [N, 1] sequence of each block
    positions = (batch.anchors.reshape(-1, 1) + torch.arange(k, device=device))[keep]  # [N, K]: p .. p+K-1
    prev_tokens = batch.input_ids[rows, positions]  # anchor, then the true tokens
    logits, conf_logits = drafter.teacher_forced_heads(hidden, prev_tokens)
    target = TopKProbs(batch.topk_ids[rows, positions], batch.topk_probs[rows, positions])
    targets = batch.input_ids[rows, positions + 1]
    to_draft = drafter.target_to_draft()
    if to_draft is not None:  # compare in the draft vocabulary's ids, where the logits are
        target, targets = target.reindexed(to_draft), to_draft[targets]
    return TeacherForced(
        logits=logits,
        conf_logits=conf_logits,
        target=target,
        targets=targets,
        row_weights=batch.anchor_weights.reshape(-1)[keep],
    )


class DrafterLoss(torch.nn.Module):
    """The drafter plus its loss as one module, so DistributedDataParallel can wrap it.
    Under a process group the losses are shares of the mean over all ranks' positions
    (`data_parallel_denominator`), so DDP's averaged gradient is that mean's gradient."""

    def __init__(self, drafter: DSparkDrafter, weights: LossWeights = LossWeights()) -> None:
        super().__init__()
        self.drafter = drafter
        self.weights = weights

    def forward(self, batch: BlockBatch) -> dict[str, torch.Tensor]:
        out = teacher_forced_blocks(self.drafter, batch)
        local = supervision_weights(out.row_weights, self.drafter.config.block_size).sum()
        return dspark_losses(
            out.logits, out.target, out.targets, out.conf_logits, out.row_weights, self.weights,
            denominator=data_parallel_denominator(local),
        )
