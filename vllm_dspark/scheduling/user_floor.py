"""No user slower than plain decoding: a per-request ledger of the time speculation won or
lost for it, and the trim that keeps every request of a pass within its allowance.

A verified draft makes the whole pass dearer, but only its own request can gain from it;
so does a drafter pass, which every request of the step waits for. The policies weigh
that cost against the pass's expected tokens (throughput, or the sum of log speeds), and
the realized-speed check (realized.py) judges recent steps per load. Neither bounds what
one request loses over its life: on chat prompts at four requests the hybrid's n-gram
continuations sped the requests that copy from their prompt, the other requests paid for
every such step, and the wave (which lasts until its slowest request is done) ran at 0.92x
plain decoding while the mean decode speed gained 2% (serving frontier of 2026-12-05,
`benchmarks/results/plain_requests_ab/chat.md`; slowest request's decode 0.91x).

`UserLedger` keeps, per request, the seconds its decode steps took (`elapsed`) and its
credit: over those steps, (tokens it emitted x a plain step at that load) - the step's
measured time, with the plain step the realized-speed check's reference (a step's own
profiled time scaled by what plain steps there measured, so that a plain step moves the
credit by noise only). A request's slack is its credit plus `allowance` x elapsed: it is
negative exactly when the request has decoded more than `allowance` slower than plain
decoding would have.

`trim_to_floor` then cuts a step's verification (it keeps the most likely drafts, as
many as fit) so that no request of the pass expects to end the step below zero: each pays
the pass's extra time, and a drafting request gains its expected accepted drafts' worth of
plain time. A request already below zero blocks any verification in its pass (its own
expected gain is not trusted: it is behind because realized gains fell short), and the
controller plans no drafting while it is (its slack then grows by `allowance` x each plain
step). So no request ends up more than `allowance` plus one step's overshoot slower than
plain decoding. Everything read is from earlier steps or from the confidences of the drafts being
judged (as with every policy), so verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Every this many steps (ledger updates) the requests not seen for as many are forgotten:
# they finished.
FORGET_AFTER_STEPS = 256


@dataclass
class _Account:
    credit: float = 0.0  # seconds won (+) or lost (-) against plain decoding
    elapsed: float = 0.0  # seconds of its timed decode steps
    last_step: int = 0


@dataclass
class UserLedger:
    """Per-request credit against plain decoding (module docstring)."""

    allowance: float
    _accounts: dict[str, _Account] = field(default_factory=dict)
    _steps: int = 0

    def add(self, request_ids: tuple[str, ...], tokens: np.ndarray, plain_step_s: float, measured_s: float) -> None:
        """One timed step: request i emitted `tokens[i]` (NaN: no output, not charged) in a
        step that took `measured_s` where a plain one takes `plain_step_s`."""
        self._steps += 1
        for request_id, emitted in zip(request_ids, tokens):
            if not np.isfinite(emitted):
                continue
            account = self._accounts.setdefault(request_id, _Account())
            account.credit += float(emitted) * plain_step_s - measured_s
            account.elapsed += measured_s
            account.last_step = self._steps
        if self._steps % FORGET_AFTER_STEPS == 0:
            horizon = self._steps - FORGET_AFTER_STEPS
            self._accounts = {r: a for r, a in self._accounts.items() if a.last_step > horizon}

    def slack(self, request_ids: tuple[str, ...] | list[str]) -> np.ndarray:
        """[len(request_ids)] credit + allowance x elapsed in seconds; inf for a request not
        charged yet (the floor bounds what it measured: a new request, or any before its
        load has a plain reference)."""
        accounts = [self._accounts.get(r) for r in request_ids]
        return np.array([np.inf if a is None else a.credit + self.allowance * a.elapsed for a in accounts])


def trim_to_floor(
    verified: np.ndarray,
    survival: np.ndarray,
    slack: np.ndarray,
    plain_slack: float,
    extra_step_s: np.ndarray,
    plain_step_s: float,
) -> np.ndarray:
    """Verification lengths [R], each at most `verified`'s, such that every request of the
    pass with slack expects to end the step with slack >= 0, and none already behind pays
    for a longer pass (its own drafts' expected gain does not count: it is behind because
    its realized gains fell short of what was expected, or others' drafts cost it).

    `survival` [R, K] is the calibrated prefix survival of the drafting requests' drafts,
    `slack` [R] theirs, `plain_slack` the least slack of the pass's other decoding
    requests (inf: none), `extra_step_s` [N + 1] the pass's extra seconds with n = 0..N
    drafts verified (N = verified.sum(), extra_step_s[0] = 0) and `plain_step_s` a plain
    step, the worth of an expected accepted draft to its request. So request i accepts
    the step's extra time up to its margin, slack_i + its kept drafts' expected gain where
    slack_i >= 0 and 0 where it is behind.

    Drafts are taken highest prefix survival first (a row's survival never rises with
    depth, so each row's are taken in order) while the extra time fits every margin; the
    first that does not fit ends the step's verification. Whether draft k of a request is
    kept so depends on the drafts taken before it: its own shallower ones (c_1..c_k, which
    do not read the k-th token) and other requests', never on its deeper confidences, so
    the trim is non-anticipating like the policies (DSPARK.md section 4)."""
    verified = np.asarray(verified, dtype=np.int64)
    if not verified.any():
        return verified
    rows, depths = np.nonzero(np.arange(survival.shape[1]) < verified[:, None])
    worth = survival[rows, depths] * plain_step_s
    order = np.lexsort((depths, -worth))  # highest survival first; ties: shallower first
    ahead = slack >= 0.0
    margin = np.where(ahead, slack, 0.0)
    plain_margin = max(plain_slack, 0.0)
    least = min(float(margin.min()), plain_margin)
    for taken, index in enumerate(order):
        row = rows[index]
        if ahead[row]:
            was_least = margin[row] <= least
            margin[row] += worth[index]
            if was_least:
                least = min(float(margin.min()), plain_margin)
        if extra_step_s[taken + 1] > least:
            return np.bincount(rows[order[:taken]], minlength=len(verified)).astype(np.int64)
    return verified
