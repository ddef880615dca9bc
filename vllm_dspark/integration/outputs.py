"""What the worker sends the scheduler each step: drafts plus their confidences.

Defined in an importable module (not `__main__`) because with the multiprocess executor
the object travels from the worker to the engine core by pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from vllm.v1.outputs import DraftTokenIds

from vllm_dspark.scheduling.hybrid import NgramProposals


# Attribute of vLLM's SchedulerOutput carrying the drafting early-stop survival from the
# scheduler to the worker (with the object in-process, by pickle to worker processes).
MIN_SURVIVAL_FIELD = "vllm_dspark_min_survival"
# Attribute of SchedulerOutput: the plan's `DrafterSkip` (or None), the worker's rule for
# leaving the drafter out of a step predicted faster with n-gram continuations alone.
DRAFTER_SKIP_FIELD = "vllm_dspark_drafter_skip"
# Attribute of SchedulerOutput: the requests whose scheduled drafts are n-gram continuations,
# verified as point masses (probability 1 on each proposed token).
POINT_MASS_FIELD = "vllm_dspark_point_mass"
# Attribute of SchedulerOutput: the scheduled requests admitted without the drafter, whose
# tokens the worker leaves out of the drafter's context (scheduling/drafter_ledger.py).
WITHOUT_DRAFTER_FIELD = "vllm_dspark_without_drafter"
# Attribute of SchedulerOutput: whether the next step may verify what is proposed after this
# one (False where the measured check keeps it plain): without it the worker looks up no
# n-gram continuations, and the scheduler has nothing to choose or rank.
VERIFIES_NEXT_FIELD = "vllm_dspark_verifies_next"


@dataclass
class DraftReport:
    """What one proposal cost: the scheduler learns drafting's price from it."""

    depth: int  # draft positions drafted (0: the scheduler or the n-gram skip left the drafter out)
    skipped_for_ngram: bool = False  # the worker left the drafter out for n-gram continuations
    lm_head_rows: int = 0  # (request, position) rows whose logits were computed
    seconds: float = 0.0


@dataclass
class DraftTokenIdsWithConfidence(DraftTokenIds):
    # [num_reqs, num_draft_tokens] calibrated conditional confidences c_k (float32), rows
    # aligned with `req_ids`; None when the drafter did not run this step.
    confidences: np.ndarray | None = None
    report: DraftReport | None = None
    # Hybrid: each request's n-gram continuation (rows aligned with `req_ids`).
    ngram: NgramProposals | None = None
