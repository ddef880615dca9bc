"""What the verification controller did, cumulative since engine start.

vLLM-free: the controller fills it, the engine's stats path carries it to the API server
(`integration/metrics.py` turns it into Prometheus metrics) and the log line prints it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class DSparkStats:
    """Cumulative counters since engine start."""

    policy: str = ""
    steps: int = 0
    proposed: int = 0  # draft tokens the drafter proposed
    verified: int = 0  # draft tokens the policy sent to verification
    accepted: int = 0  # verified draft tokens the target accepted
    predicted_accepted: float = 0.0  # sum of prefix survival a_k over verified tokens
    verified_requests: int = 0  # (request, step) pairs that verified >= 0 drafts
    missing_confidences: int = 0
    invalid_confidences: int = 0
    # The learned step-time model, drafting left out: measured ~ scale * profiled + offset.
    step_time_scale: float = 1.0
    step_overhead_ms: float = 0.0
    # Live recalibration per sampling mode ("greedy", "sampled") and block position:
    # c' = sigmoid(slope * logit(c) + shift).
    confidence_slopes: dict[str, list[float]] = field(default_factory=dict)
    confidence_shifts: dict[str, list[float]] = field(default_factory=dict)
    # verified_length_counts[l] = number of (request, step) pairs that verified l drafts
    verified_length_counts: list[int] = field(default_factory=list)
    # Drafting: steps planned per depth (draft_depth_counts[0] = steps that drafted
    # nothing), LM-head rows the drafter computed, its seconds in all.
    draft_depth_counts: list[int] = field(default_factory=list)
    lm_head_rows: int = 0
    drafting_seconds: float = 0.0
    # Steps where the measured check (scheduling/realized.py) overruled speculating.
    vetoed_steps: int = 0
    # Steps that drafted nothing (n-gram continuations still verified) because steps with the
    # drafter measured slower than steps with n-gram proposals alone (hybrid).
    drafter_vetoed_steps: int = 0
    # Steps that drafted nothing so that check has steps without the drafter to compare with.
    drafter_reference_steps: int = 0
    # Plain steps asked for by that check because a load had no plain step to compare with.
    reference_steps: int = 0
    # The part of proposed / verified / accepted that came from n-gram lookups (hybrid).
    ngram_proposed: int = 0
    # Steps the worker left the drafter out, predicted faster with n-gram continuations alone.
    drafter_skipped_steps: int = 0
    ngram_verified: int = 0
    ngram_accepted: int = 0
    # Requests admitted without the drafter: it measured no gain at their load (drafter_ledger.py).
    requests_without_drafter: int = 0

    @property
    def pruned(self) -> int:
        return self.proposed - self.verified

    @property
    def calibration_error(self) -> float:
        """Mean over verified drafts of predicted survival minus observed acceptance
        (0 = calibrated, > 0 = over-confident)."""
        return (self.predicted_accepted - self.accepted) / max(1, self.verified)

    def record_decision(self, proposed: np.ndarray, verified: np.ndarray, ngram: np.ndarray | None = None) -> None:
        """One step: drafts proposed and verified per request; `ngram` [R] bool marks the
        requests whose proposal came from the n-gram lookup."""
        self.steps += 1
        self.proposed += int(proposed.sum())
        self.verified += int(verified.sum())
        if ngram is not None:
            self.ngram_proposed += int(proposed[ngram].sum())
            self.ngram_verified += int(verified[ngram].sum())
        self.verified_requests += len(verified)
        width = max(int(proposed.max(initial=0)) + 1, len(self.verified_length_counts))
        counts = np.bincount(verified.astype(np.int64), minlength=width)
        counts[: len(self.verified_length_counts)] += np.asarray(self.verified_length_counts, dtype=np.int64)
        self.verified_length_counts = counts.tolist()

    def record_plan(self, depth: int) -> None:
        if len(self.draft_depth_counts) <= depth:
            self.draft_depth_counts += [0] * (depth + 1 - len(self.draft_depth_counts))
        self.draft_depth_counts[depth] += 1

    def record_drafting(self, lm_head_rows: int, seconds: float) -> None:
        self.lm_head_rows += lm_head_rows
        self.drafting_seconds += seconds

    def summary(self) -> str:
        return (
            f"policy {self.policy}: {self.steps} steps, drafts proposed {self.proposed}, "
            f"verified {self.verified}, pruned {self.pruned} "
            f"({100.0 * self.pruned / max(1, self.proposed):.1f}%), accepted {self.accepted} "
            f"(predicted {self.predicted_accepted:.1f}, calibration error "
            f"{self.calibration_error:+.3f} per verified draft), mean verification budget "
            f"{self.verified / max(1, self.verified_requests):.2f} tokens/request, steps "
            f"{self.step_time_scale:.2f} x the SPS profile {self.step_overhead_ms:+.1f} ms, draft depth per step "
            f"{self.draft_depth_counts} (index = depth), {self.lm_head_rows} LM-head rows, "
            f"{self.drafting_seconds:.1f} s drafting, {self.vetoed_steps} steps not speculating on measured losses, "
            f"{self.reference_steps} plain reference steps"
            + (f", n-gram drafts proposed {self.ngram_proposed}, verified {self.ngram_verified}, "
               f"accepted {self.ngram_accepted}, drafter left out on {self.drafter_skipped_steps} steps, "
               f"not drafting on {self.drafter_vetoed_steps} steps where steps without the drafter measured faster "
               f"and on {self.drafter_reference_steps} reference steps for that check"
               if self.ngram_proposed else "")
            + (f", {self.requests_without_drafter} requests admitted without the drafter"
               if self.requests_without_drafter else "")
            + "".join(
                f", {mode} confidence recalibration: slopes {[round(x, 2) for x in self.confidence_slopes[mode]]} "
                f"shifts {[round(x, 2) for x in shifts]}"
                for mode, shifts in self.confidence_shifts.items()
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for vLLM's stats messages from the engine core to the API server."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSparkStats:
        return cls(**data)
