"""`vllm-dspark calibrate`: Sequential Temperature Scaling of the confidence head (DSPARK.md section 3).

The scheduler ranks draft positions by prefix survival a_k = c_1 * ... * c_k, so what must
be calibrated is a_k, not each c_k alone. STS fits one temperature per position, in order:
T_k minimises a loss of a_k = a_{k-1} * sigmoid(logit_k / T_k) against the observed survival
with T_1..T_{k-1} already fixed. Scaling a logit by a positive factor keeps the order of
confidences at each position.

The loss. DSPARK.md names the expected calibration error (ECE, `--objective ece`). ECE
rewards calibration only, not resolution, and a large enough temperature makes every c_k
the base rate, which is perfectly calibrated and useless for ranking: on the drafter
continued on 2026-12-03 it chose T_1 = 31.6 (the grid's end; every c_1 about 0.50, ECE of
a_1 0.018 -> 0.007) and left a_2 worse than before (0.010 -> 0.034). The default is the
Brier score (mean squared error of a_k), a proper scoring rule: its minimum is calibrated
and keeps what separates the drafts that survive from those that do not.

Observed survival. On held-out features the drafter runs teacher-forced (true previous
tokens), and the survival of position k is taken as the exact expected value
prod_{j<=k} (1 - 0.5 ||p_d,j - p_t,j||_1), the product of exact acceptance probabilities,
rather than Bernoulli draws of it: both have the same expectation per bin, the exact value
has no sampling noise. Caveat: teacher forcing conditions on the data's tokens, whereas at
serving time position j+1 follows a drafted token that was accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from vllm_dspark.config import ConfigError
from vllm_dspark.model.drafter import WEIGHTS_FILE, DSparkDrafter
from vllm_dspark.training.blocks import pack_batch, teacher_forced_blocks, usable_sequences
from vllm_dspark.training.features import FeatureError, FeatureStore, check_source_fits
from vllm_dspark.training.losses import acceptance_label, total_variation_l1

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
# Geometric grid of temperatures; 1.0 (no change) is on it.
TEMPERATURE_GRID = torch.logspace(-1.5, 1.5, 241)


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 15) -> float:
    """Sum over equal-width bins of (bin share) * |mean predicted - mean observed|."""
    index = (predicted * bins).long().clamp(0, bins - 1)
    gap = torch.bincount(index, predicted, bins) - torch.bincount(index, observed, bins)
    return float(gap.abs().sum() / len(predicted))


def survival_curves(conf_logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """a_k = prod_{j<=k} sigmoid(logit_j / T_j); [N, K]."""
    temps = conf_logits.new_tensor(temperatures)
    return torch.cumprod(torch.sigmoid(conf_logits / temps), dim=1)


def brier_score(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 15) -> float:
    """Mean squared error of the predicted survival (`bins` unused: one signature for both losses)."""
    return float(((predicted - observed) ** 2).mean())


OBJECTIVES = {"brier": brier_score, "ece": expected_calibration_error}
# Losses this close to the best count as ties (broken towards T = 1). The Brier score is
# flat (quadratic) at its minimum, so its tie band is narrower: on 3x over-confident
# synthetic logits 1e-3 stops at T_1 = 2.5, 1e-5 finds the true 3.0.
DEFAULT_TOLERANCE = {"brier": 1e-5, "ece": 1e-3}


def tie_tolerance(objective: str, tolerance: float | None) -> float:
    return DEFAULT_TOLERANCE[objective] if tolerance is None else tolerance


def sequential_temperature_scaling(
    conf_logits: torch.Tensor,
    survival: torch.Tensor,
    bins: int = 15,
    grid: torch.Tensor = TEMPERATURE_GRID,
    tolerance: float | None = None,
    objective: str = "brier",
) -> list[float]:
    """T_1..T_K, each chosen by grid search with the earlier ones fixed.

    Among temperatures whose loss is within `tolerance` of the best, the one closest to 1
    wins: late positions survive so rarely that their loss is tiny and flat in T, and a
    plain argmin there picks extreme temperatures (0.03) that would turn c_k into 0/1
    at serving time on prompts where the drafter does survive that far."""
    loss = OBJECTIVES[objective]
    tolerance = tie_tolerance(objective, tolerance)
    temperatures: list[float] = []
    prefix = torch.ones(len(conf_logits), dtype=conf_logits.dtype)
    for k in range(conf_logits.shape[1]):
        losses = torch.tensor([
            loss(prefix * torch.sigmoid(conf_logits[:, k] / t), survival[:, k], bins) for t in grid.tolist()
        ])
        near_best = losses <= losses.min() + tolerance
        best = float(grid[near_best][grid[near_best].log().abs().argmin()])
        temperatures.append(best)
        prefix = prefix * torch.sigmoid(conf_logits[:, k] / best)
    return temperatures


def loss_per_position(
    objective: str, conf_logits: torch.Tensor, survival: torch.Tensor, temperatures: list[float], bins: int = 15
) -> list[float]:
    """The loss `objective` of a_k at every position k under `temperatures`."""
    predicted, loss = survival_curves(conf_logits, temperatures), OBJECTIVES[objective]
    return [loss(predicted[:, k], survival[:, k], bins) for k in range(predicted.shape[1])]


def ece_per_position(conf_logits: torch.Tensor, survival: torch.Tensor, temperatures: list[float], bins: int) -> list[float]:
    return loss_per_position("ece", conf_logits, survival, temperatures, bins)


@torch.no_grad()
def collect_confidences(
    drafter: DSparkDrafter, store: FeatureStore, anchors_per_seq: int, batch_seqs: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw confidence logits [N, K] and exact acceptance probabilities [N, K] of up to
    `anchors_per_seq` evenly spread blocks of every held-out sequence."""
    drafter.eval()
    indices = usable_sequences(store, drafter.config.block_size)
    if not indices:
        raise FeatureError(f"no held-out sequence in {store.dir} is long enough for block_size {drafter.config.block_size}")
    logits_out, accept_out = [], []
    for start in range(0, len(indices), batch_seqs):
        batch = pack_batch([store.get(i) for i in indices[start : start + batch_seqs]], anchors_per_seq, drafter.config.block_size, None)
        out = teacher_forced_blocks(drafter, batch)
        logits_out.append(out.conf_logits)
        accept_out.append(acceptance_label(total_variation_l1(torch.softmax(out.logits, -1), out.target)))
    return torch.cat(logits_out), torch.cat(accept_out)


def reliability_diagram(
    conf_logits: torch.Tensor, survival: torch.Tensor, temperatures: list[float], png: Path, bins: int
) -> None:
    """Mean predicted vs mean observed prefix survival per bin and position, before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = conf_logits.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    colours = plt.cm.viridis(torch.linspace(0, 0.9, k).tolist())
    for ax, title, temps in ((axes[0], "raw", [1.0] * k), (axes[1], "after STS", temperatures)):
        predicted = survival_curves(conf_logits, temps)
        eces = ece_per_position(conf_logits, survival, temps, bins)
        for pos in range(k):
            index = (predicted[:, pos] * bins).long().clamp(0, bins - 1)
            count = torch.bincount(index, minlength=bins)
            used = count > 0
            mean_pred = torch.bincount(index, predicted[:, pos], bins)[used] / count[used]
            mean_obs = torch.bincount(index, survival[:, pos], bins)[used] / count[used]
            ax.plot(mean_pred, mean_obs, "o-", ms=3, color=colours[pos], label=f"a_{pos + 1}  ECE {eces[pos]:.3f}")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(title=f"{title}: mean ECE {sum(eces) / k:.3f}", xlabel="predicted prefix survival a_k", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("observed survival (product of exact acceptance probabilities)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def calibrate(
    target: Path,
    drafter_dir: Path,
    features: Path,
    out: Path,
    png: Path | None,
    anchors_per_seq: int,
    bins: int,
    tolerance: float | None = None,
    objective: str = "brier",
) -> dict:
    drafter = DSparkDrafter.from_pretrained(drafter_dir, target)
    if drafter.confidence_head is None:
        raise ConfigError(f"{drafter_dir} has no confidence head (enable_confidence_head is false)")
    store = FeatureStore(features)
    check_source_fits(store, drafter.config, target, str(features))
    conf_logits, accept = collect_confidences(drafter, store, anchors_per_seq)
    survival = torch.cumprod(accept, dim=1)
    temperatures = sequential_temperature_scaling(conf_logits, survival, bins, tolerance=tolerance, objective=objective)
    k = drafter.config.block_size
    report = {
        "blocks": len(conf_logits),
        "sequences": len(store),
        "observed_survival": "product of exact acceptance probabilities (teacher forcing)",
        "bins": bins,
        "objective": objective,
        "tolerance": tie_tolerance(objective, tolerance),
        "temperatures": [round(t, 4) for t in temperatures],
        "ece_before": ece_per_position(conf_logits, survival, [1.0] * k, bins),
        "ece_after": ece_per_position(conf_logits, survival, temperatures, bins),
        "brier_before": loss_per_position("brier", conf_logits, survival, [1.0] * k),
        "brier_after": loss_per_position("brier", conf_logits, survival, temperatures),
        "mean_survival": survival.mean(0).tolist(),
    }
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != drafter_dir.resolve():
        shutil.copyfile(drafter_dir / WEIGHTS_FILE, out / WEIGHTS_FILE)
    drafter.config.confidence_temperatures = report["temperatures"]
    drafter.config.save(out)
    (out / CALIBRATION_FILE).write_text(json.dumps(report, indent=2) + "\n")
    if png is not None:
        reliability_diagram(conf_logits, survival, temperatures, png, bins)
    return report


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        report = calibrate(
            args.target, args.drafter, args.features, args.out, args.png, args.anchors_per_seq, args.bins, args.tolerance,
            args.objective,
        )
    except (FeatureError, ConfigError, OSError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 1
    print(f"calibrate: {report['blocks']} held-out blocks from {report['sequences']} sequences")
    print("position  T_k     ECE before  ECE after  mean survival")
    for k, (t, before, after, surv) in enumerate(
        zip(report["temperatures"], report["ece_before"], report["ece_after"], report["mean_survival"]), 1
    ):
        print(f"{k:8d}  {t:6.3f}  {before:10.4f}  {after:9.4f}  {surv:13.3f}")
    print(f"temperatures written to {args.out / 'config.json'}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="Sequential Temperature Scaling of drafter confidences")
    parser.add_argument("--target", type=Path, required=True, help="HF target checkpoint directory")
    parser.add_argument("--drafter", type=Path, required=True, help="trained drafter directory")
    parser.add_argument("--features", type=Path, required=True, help="held-out feature directory")
    parser.add_argument("--out", type=Path, required=True, help="calibrated drafter directory (may be --drafter)")
    parser.add_argument("--png", type=Path, default=None, help="reliability diagram to write")
    parser.add_argument("--anchors-per-seq", type=int, default=64, help="blocks per held-out sequence")
    parser.add_argument("--bins", type=int, default=15, help="ECE bins")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="brier",
                        help="what each T_k minimises: brier (default; proper, keeps resolution) or ece "
                             "(DSPARK.md's; a temperature that makes every confidence the base rate wins it)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="prefer the temperature closest to 1 among those this close to the best loss "
                             "(default 1e-5 for brier, 1e-3 for ece)")
    parser.set_defaults(func=_run)
