"""Losses, block packing, anchors, learning-rate schedule and STS on small hand-made cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_drafter
from vllm_dspark.model.drafter import DSparkDrafter, block_mask
from vllm_dspark.training.blocks import choose_anchors, valid_anchors
from vllm_dspark.training.calibrate import (
    brier_score,
    ece_per_position,
    expected_calibration_error,
    sequential_temperature_scaling,
    survival_curves,
)
from vllm_dspark.training.losses import (
    acceptance_label,
    dspark_losses,
    position_weights,
    total_variation_l1,
)
from vllm_dspark.training.soft_labels import TopKProbs, coverage
from vllm_dspark.training.train import RunSettings, lr_at


def test_position_weights() -> None:
    w = position_weights(4)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))


def test_tv_and_acceptance_label_by_hand() -> None:
    p_d = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p_t = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.3, 0.5]])
    tv = total_variation_l1(p_d, TopKProbs.of(p_t, 3))
    assert torch.allclose(tv, torch.tensor([0.4, 0.0]), atol=1e-6)
    # Rejection sampling accepts with sum_v min(p_d, p_t) = 0.5 * 0.7 ... = 0.8 here.
    assert torch.allclose(acceptance_label(tv), torch.tensor([0.8, 1.0]))


def test_dspark_losses_by_hand() -> None:
    # One block, two positions, vocabulary of 2: p_d = (0.5, 0.5) then (0.8, 0.2).
    logits = torch.tensor([[[0.0, 0.0], [math.log(4.0), 0.0]]], requires_grad=True)
    p_t = torch.tensor([[[0.7, 0.3], [0.8, 0.2]]])
    targets = torch.tensor([[1, 0]])
    conf = torch.tensor([[0.0, 2.0]], requires_grad=True)
    out = dspark_losses(logits, TopKProbs.of(p_t, 2), targets, conf, torch.ones(1))
    w = torch.tensor([1.0, math.exp(-0.5)])
    ce = torch.tensor([-math.log(0.5), -math.log(0.8)])
    tv = torch.tensor([0.4, 0.0])
    label = torch.tensor([0.8, 1.0])
    p_conf = torch.sigmoid(torch.tensor([0.0, 2.0]))
    bce = -(label * p_conf.log() + (1 - label) * (1 - p_conf).log())
    expect = {"ce": ce, "tv": tv, "conf": bce}
    for name, values in expect.items():
        assert out[name].item() == pytest.approx(float((w * values).sum() / w.sum()), abs=1e-5), name
    total = 0.1 * out["ce"] + 0.9 * out["tv"] + 1.0 * out["conf"]
    assert out["total"].item() == pytest.approx(total.item(), abs=1e-6)
    # The label is detached: the confidence loss must not move the draft distribution.
    out["conf"].backward()
    assert logits.grad is None or torch.all(logits.grad == 0)
    assert conf.grad is not None and conf.grad.abs().sum() > 0


def test_padding_blocks_do_not_count() -> None:
    logits = torch.randn(2, 3, 5)
    p_t = TopKProbs.of(torch.softmax(torch.randn(2, 3, 5), -1), 3)
    targets = torch.randint(0, 5, (2, 3))
    conf = torch.randn(2, 3)
    both = dspark_losses(logits, p_t, targets, conf, torch.tensor([1.0, 0.0]))
    first = dspark_losses(logits[:1], p_t[:1], targets[:1], conf[:1], torch.ones(1))
    for name in ("ce", "tv", "conf", "total"):
        assert both[name].item() == pytest.approx(first[name].item(), rel=1e-6)


def test_reduced_vocabulary_targets_outside_the_subset_stay_finite() -> None:
    """A drafter whose vocabulary lacks target token 2 (draft ids 0, 1 = target ids 0, 1):
    the block whose true next token is 2 adds no CE but its unreachable mass to TV;
    gradients finite."""
    logits = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], requires_grad=True)
    p_t = torch.tensor([[[0.2, 0.2, 0.6], [0.5, 0.5, 0.0]]])
    to_draft = torch.tensor([0, 1, -1])
    target = TopKProbs.of(p_t, 3).reindexed(to_draft)
    out = dspark_losses(logits, target, to_draft[torch.tensor([[2, 1]])], None, torch.ones(1))
    w = position_weights(2)
    q = torch.cat([torch.softmax(logits.detach(), -1), torch.zeros(1, 2, 1)], -1)  # 0 on token 2
    assert out["ce"].item() == pytest.approx(float(w[1] * -q[0, 1, 1].log() / w.sum()), rel=1e-5)
    assert out["tv"].item() == pytest.approx(float((w * (q - p_t).abs().sum(-1)[0]).sum() / w.sum()), rel=1e-5)
    out["total"].backward()
    assert torch.isfinite(logits.grad).all()


def test_draft_vocabulary_losses_equal_the_target_vocabulary_view() -> None:
    """Losses computed over a reduced draft vocabulary's own ids (what training does) equal
    those of the same logits widened to the target vocabulary with -inf outside the subset."""
    generator = torch.Generator().manual_seed(0)
    vocab, subset = 50, torch.tensor([3, 7, 8, 20, 21, 30, 41, 49])
    to_draft = torch.full((vocab,), -1)
    to_draft[subset] = torch.arange(len(subset))
    logits = torch.randn(4, 3, len(subset), generator=generator)
    p_t = torch.softmax(2 * torch.randn(4, 3, vocab, generator=generator), -1)
    p_t[..., subset] += 0.05  # some kept tokens inside the subset, some outside
    target = TopKProbs.of(p_t / p_t.sum(-1, keepdim=True), 6)
    targets = torch.where(torch.rand(4, 3, generator=generator) < 0.5, subset[torch.randint(0, 8, (4, 3), generator=generator)],
                          torch.randint(0, vocab, (4, 3), generator=generator))
    conf, rows = torch.randn(4, 3, generator=generator), torch.ones(4)
    widened = torch.full((4, 3, vocab), float("-inf"))
    widened[..., subset] = logits
    reduced = dspark_losses(logits, target.reindexed(to_draft), to_draft[targets], conf, rows)
    # The widened view's CE skips the same blocks: targets outside the subset get -inf.
    full = dspark_losses(widened, target, targets.masked_fill(to_draft[targets] < 0, -1), conf, rows)
    for name in ("ce", "tv", "conf", "total"):
        assert reduced[name].item() == pytest.approx(full[name].item(), rel=1e-5), name
    assert (to_draft[targets] < 0).any() and (target.reindexed(to_draft).ids < 0).any()


def test_top_k_tv_within_its_stated_bound_of_the_full_one() -> None:
    """On peaked and flat random distributions: TV from the top k is never below the full
    one and exceeds it by at most 2 min(q_out, r); with k = V it is the full one."""
    generator = torch.Generator().manual_seed(0)
    vocab = 200
    for sharpness in (0.5, 3.0):
        p_t = torch.softmax(sharpness * torch.randn(64, vocab, generator=generator), -1)
        p_d = torch.softmax(sharpness * torch.randn(64, vocab, generator=generator), -1)
        full = (p_d - p_t).abs().sum(-1)
        assert torch.allclose(total_variation_l1(p_d, TopKProbs.of(p_t, vocab)), full, atol=1e-5)
        for k in (1, 8, 50):
            target = TopKProbs.of(p_t, k)
            approx = total_variation_l1(p_d, target)
            q_out = 1 - p_d.gather(-1, target.ids).sum(-1)
            assert torch.all(approx >= full - 1e-5)
            assert torch.all(approx - full <= 2 * torch.minimum(q_out, target.rest) + 1e-5)
            assert not torch.allclose(approx, full)  # the bound is not vacuous: some error exists
    kept = coverage(torch.log(p_t), [1, 8, vocab])
    assert kept[1] < kept[8] < kept[vocab] == pytest.approx(1.0)


def test_valid_anchors_keep_whole_block_in_response() -> None:
    # 10 tokens, response starts at 4, block 3: anchor p needs p+1..p+3 in [4, 9].
    assert valid_anchors(10, 4, 3).tolist() == [3, 4, 5, 6]
    assert valid_anchors(6, 4, 3).tolist() == []
    anchors, weights = choose_anchors(torch.tensor([3, 4]), 4, None)
    assert anchors.tolist()[:2] == [3, 4] and weights.tolist() == [1, 1, 0, 0]
    anchors, weights = choose_anchors(torch.arange(3, 20), 5, torch.Generator().manual_seed(0))
    assert len(set(anchors.tolist())) == 5 and weights.sum() == 5


def test_block_mask_layout() -> None:
    mask = block_mask(torch.tensor([[2, 5]]), context_len=7, slots=3)[0]
    assert mask.shape == (6, 7 + 6)
    # Block 0 (rows 0-2): context positions 0, 1 and its own three slots.
    assert mask[0, :7].tolist() == [True, True, False, False, False, False, False]
    assert mask[0, 7:].tolist() == [True, True, True, False, False, False]
    # Block 1 (rows 3-5): context 0..4 and its own slots only.
    assert mask[4, :7].tolist() == [True] * 5 + [False] * 2
    assert mask[4, 7:].tolist() == [False, False, False, True, True, True]


def test_packed_block_never_sees_later_context_or_other_blocks(tiny_target: Path, tmp_path: Path) -> None:
    drafter = DSparkDrafter.from_pretrained(make_drafter(tiny_target, tmp_path / "d"), tiny_target)
    torch.manual_seed(0)
    width = drafter.fc.in_features
    context = torch.randn(1, 12, width)
    blocks = drafter.block_input_ids(torch.tensor([[5, 9]]), 4)
    anchors = torch.tensor([[4, 8]])
    with torch.no_grad():
        base = drafter.backbone(context, blocks, anchors)
        changed_context = context.clone()
        changed_context[:, 4:] += 5.0  # the anchor's own position and later
        other_block = blocks.clone()
        other_block[0, 1, 0] = 77
        a = drafter.backbone(changed_context, blocks, anchors)
        b = drafter.backbone(context, other_block, anchors)
    assert torch.allclose(a[0, 0], base[0, 0], atol=1e-5)  # block 0 blind to positions >= 4
    assert not torch.allclose(a[0, 1], base[0, 1])  # block 1 (anchor 8) does see 4..7
    assert torch.allclose(b[0, 0], base[0, 0], atol=1e-5)  # nor does it see block 1


def test_lr_schedule() -> None:
    s = RunSettings(steps=100, lr=1e-3, min_lr_frac=0.1, warmup_frac=0.1, weight_decay=0.0,
                    grad_clip=1.0, batch_seqs=1, anchors_per_seq=1, seed=0, world_size=1, bf16=False)
    assert lr_at(0, s) == pytest.approx(1e-4)
    assert lr_at(9, s) == pytest.approx(1e-3)
    assert lr_at(99, s) == pytest.approx(1e-4, rel=0.01)
    assert all(lr_at(i, s) >= lr_at(i + 1, s) for i in range(10, 99))


def test_ece_by_hand() -> None:
    predicted = torch.tensor([0.05, 0.05, 0.95, 0.95])
    observed = torch.tensor([0.0, 0.0, 1.0, 0.0])
    # Bin of 0.05: gap 0.05 on half the data; bin of 0.95: gap 0.45 on the other half.
    assert expected_calibration_error(predicted, observed, bins=10) == pytest.approx(0.25)


def test_sts_lowers_ece_on_overconfident_data() -> None:
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(20000, 4, generator=generator) + 1.5
    survival = torch.cumprod(torch.sigmoid(true_logits), dim=1)
    reported = 3.0 * true_logits  # over-confident by a factor of 3 in logit space
    temps = sequential_temperature_scaling(reported, survival, bins=15)
    before = ece_per_position(reported, survival, [1.0] * 4, 15)
    after = ece_per_position(reported, survival, temps, 15)
    assert temps[0] == pytest.approx(3.0, rel=0.1)
    assert all(a < 0.3 * b for a, b in zip(after, before)), (before, after)
    assert max(after) < 0.01


def test_sts_by_ece_collapses_a_biased_head_and_brier_does_not() -> None:
    """Logits biased by +1: no temperature calibrates them, but one large enough makes every
    confidence about the base rate, which ECE scores nearly perfect. The Brier score keeps
    the confidences apart (a scheduler ranks by them) and ends closer to the truth."""
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(20000, 1, generator=generator)
    survival = torch.sigmoid(true_logits)
    reported = true_logits + 1.0
    by_ece = sequential_temperature_scaling(reported, survival, objective="ece")
    by_brier = sequential_temperature_scaling(reported, survival)
    assert by_ece[0] > 20 and 1.5 < by_brier[0] < 4, (by_ece, by_brier)
    ece_curve, brier_curve = survival_curves(reported, by_ece)[:, 0], survival_curves(reported, by_brier)[:, 0]
    assert ece_curve.std() < 0.02 < 0.08 < brier_curve.std()
    assert brier_score(brier_curve, survival[:, 0]) < 0.7 * brier_score(ece_curve, survival[:, 0])


def test_sts_keeps_temperature_one_where_ece_is_flat() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5000, 2, generator=generator)
    logits[:, 1] -= 8.0  # position 2 predicts ~3e-4 and never survives:
    survival = torch.stack([torch.sigmoid(logits[:, 0]), torch.zeros(5000)], dim=1)
    # the smallest temperature "wins" by a margin far below any meaningful ECE difference.
    assert sequential_temperature_scaling(logits, survival, tolerance=0.0)[1] < 0.1
    assert sequential_temperature_scaling(logits, survival)[1] == pytest.approx(1.0)
