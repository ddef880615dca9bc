"""Context K/V of steps that drafted nothing, stored later in one batch.

Every engine step turns the target's new hidden states into K/V in the drafter's cache
(the "context pass"), so that a later draft sees the whole context. A step that drafts
nothing needs none of it yet, and at a load where the controller keeps decoding plainly
the pass is most of what speculation still costs per step (about 1 ms of a 23 ms step at
four requests on a CPU, `benchmarks/results/drafting_breakdown.md`): a fixed cost of
about twenty small operations whatever the number of tokens. Such steps therefore only
queue their states with the cache slots vLLM assigned them, and the queue is written, in
one pass, before the drafter next reads its cache.

Writing later changes nothing the drafter reads: every write goes to the slot vLLM chose
at its own step, writes happen in their original order (a slot written twice, e.g. a
freed block given to a new request, or a rejected draft's position written again with
the accepted token, keeps its last value), and the queue is always emptied before a
drafter forward pass. Drafts stay exactly what they would be (up to the rounding of one
batched matrix product instead of several), and verification is lossless regardless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Slots below zero are padding: vLLM's cache writes skip them.
PADDING_SLOT = -1


@dataclass
class ContextRows:
    """One step's context: target states (as the runner hands them over, before the
    drafter's `fc`), their positions and the drafter-cache slots vLLM gave them."""

    hidden_states: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor

    def __len__(self) -> int:
        return self.hidden_states.shape[0]

    def select(self, keep: torch.Tensor) -> ContextRows:
        """The rows where `keep` [len(self)] is true."""
        index = torch.nonzero(keep.to(self.hidden_states.device), as_tuple=True)[0]
        return ContextRows(self.hidden_states[index], self.positions[index], self.slots[index])


@dataclass
class DeferredContext:
    """Context rows waiting to be written, oldest first; `full` once they reach
    `max_tokens`. What waiting saves is the pass's fixed cost per step; its arithmetic
    (the drafter's `fc` over five target layers and the K/V projections, about 8 MFLOP
    per token for SmolLM2's drafter) is only batched. The cap bounds the memory held and
    the one step that writes a full queue: 256 tokens take about a plain step's time on a
    2-core CPU, paid once every 64 steps at four requests."""

    max_tokens: int = 256
    _pending: list[ContextRows] = field(default_factory=list)
    _num_tokens: int = 0

    def add(self, rows: ContextRows) -> None:
        """Queue `rows`, copying their positions and slots (views of the proposer's
        reused buffers; the runner's hidden states are a fresh tensor every step)."""
        self._pending.append(ContextRows(rows.hidden_states, rows.positions.clone(), rows.slots.clone()))
        self._num_tokens += len(rows)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def full(self) -> bool:
        return self._num_tokens >= self.max_tokens

    def take(self) -> ContextRows | None:
        """Everything queued as one batch whose writes land as the queued ones would in
        order (earlier writes to a slot written again are turned into padding); None
        when nothing is queued."""
        if not self._pending:
            return None
        pending, self._pending, self._num_tokens = self._pending, [], 0
        if len(pending) == 1:
            rows = pending[0]
        else:
            rows = ContextRows(
                torch.cat([r.hidden_states for r in pending]),
                torch.cat([r.positions for r in pending]),
                torch.cat([r.slots for r in pending]),
            )
        return ContextRows(rows.hidden_states, rows.positions, last_writes_only(rows.slots))


def last_writes_only(slots: torch.Tensor) -> torch.Tensor:
    """`slots` with every write that a later one to the same slot overwrites replaced by
    padding, so that one unordered scatter leaves what the writes in order leave. No
    host synchronisation (the result has the input's shape)."""
    if slots.numel() < 2:
        return slots
    sorted_slots, order = torch.sort(slots, stable=True)  # equal slots keep their order
    last_of_run = torch.ones_like(sorted_slots, dtype=torch.bool)
    last_of_run[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    is_last = torch.empty_like(last_of_run).scatter_(0, order, last_of_run)
    return torch.where(is_last, slots, torch.full_like(slots, PADDING_SLOT))
