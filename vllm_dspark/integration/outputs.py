"""What the worker sends the scheduler each step: drafts plus their confidences.

Defined in an importable module (not `__main__`) because with the multiprocess executor
the object travels from the worker to the engine core by pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from vllm.v1.outputs import DraftTokenIds


@dataclass
class DraftTokenIdsWithConfidence(DraftTokenIds):
    # [num_reqs, num_draft_tokens] calibrated conditional confidences c_k (float32), rows
    # aligned with `req_ids`; None when the drafter did not run this step.
    confidences: np.ndarray | None = None
