"""Hybrid proposals: an n-gram lookup in the request's own tokens beside the drafter.

SmolLM2 copies from its context a lot (code, lists, restated questions); there a prompt
lookup beats a parallel drafter. Each step the worker looks up, for every request, the
longest recent earlier occurrence of the context's suffix (`lookup_continuations`, up to
`MAX_MATCH` tokens matched) and hands the up-to-K tokens that followed it to the scheduler
with the drafter's block. The controller then takes, per request, the proposal with more
expected accepted tokens, and ranks the chosen proposals' prefix survivals under one
budget exactly as before.

Exactness (DSPARK.md section 4, extended): rejection sampling is lossless for a draft
drawn from q if the decision to verify it does not depend on the draw. An n-gram
continuation is deterministic given the context, so it is a draw from the point mass
q = 1 on the proposed token; the worker hands the rejection sampler exactly that
distribution for the requests whose n-gram proposal was chosen. The choice itself reads
only what exists before the drafter's tokens are drawn: the context (match length,
continuation length), the drafter's first confidence c_1 (it reads the anchor token and
the first hidden state, not x_1), this step's planned draft depth and statistics of
earlier steps. It never reads the drafter's tokens, their later confidences or how
early the drafter stopped a request, which all depend on the draws. So the verified
tokens are still distributed as the target's samples.

The n-gram proposal's confidences are learned online from its own outcomes
(`NgramConfidence`): the conditional acceptance per (sampling mode, match length,
position), counted with a uniform prior and slow forgetting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A match shorter than this is too weak a signal; longer than MAX_MATCH is not searched.
MIN_MATCH = 2
MAX_MATCH = 8
# Match lengths MIN_MATCH .. MATCH_BUCKETS + MIN_MATCH - 1 are learned apart, longer ones
# share the last bucket.
MATCH_BUCKETS = 5
SAMPLING_MODES = ("greedy", "sampled")
# A request's situation for the drafter skip (`continuation_keys`): 0 without a
# continuation, 1 + its match bucket with one.
CONTINUATION_KEYS = 1 + MATCH_BUCKETS


@dataclass(frozen=True)
class NgramProposals:
    """One step's n-gram continuations, rows aligned with the drafter's request ids."""

    tokens: np.ndarray  # [N, K] int64, valid up to `lengths`
    lengths: np.ndarray  # [N] continuation length (0: no match)
    matches: np.ndarray  # [N] matched suffix length (0: no match)


def lookup_continuations(
    token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray, k: int, max_model_len: int,
    max_match: int = MAX_MATCH, most_recent: bool = True,
) -> NgramProposals:
    """N-gram continuations for `rows` of `token_ids` [batch, max_len], whose first
    `num_tokens[row]` entries are that request's prompt and output so far (the layout of
    vLLM's input batch): per row the most recent earlier end position whose preceding
    tokens match the context's suffix longest (at most `max_match`), and up to k tokens that
    followed it, never past `max_model_len`. `most_recent=False` takes the earliest such
    position instead, vLLM's rule (benchmarks/ngram_lookup_rules.py compares the two).

    Vectorised over rows, no loop over requests (numba, which vLLM's own lookup uses,
    breaks vLLM 0.32's CPU kernel overrides for every later engine in the process). Only
    the positions holding the context's last token can end a match, so one comparison over
    the contexts finds them and the match is extended backwards over those candidates
    alone, not over every position (the worker runs this on most steps)."""
    rows = np.asarray(rows, dtype=np.int64)
    tokens = np.zeros((len(rows), k), dtype=np.int64)
    lengths = np.zeros(len(rows), dtype=np.int64)
    matches = np.zeros(len(rows), dtype=np.int64)
    context_lengths = np.asarray(num_tokens)[rows].astype(np.int64)
    if not len(rows) or not k or context_lengths.max() <= MIN_MATCH:
        return NgramProposals(tokens, lengths, matches)
    width = int(context_lengths.max())
    context = np.asarray(token_ids)[rows, :width]
    last = context_lengths - 1
    suffix_end = context[np.arange(len(rows)), np.maximum(last, 0)]
    # Candidate ends: strictly before the suffix's own end, holding its last token.
    candidates = (context == suffix_end[:, None]) & (np.arange(width)[None, :] < last[:, None])
    row_of, end_of = np.nonzero(candidates)
    run = np.ones(len(row_of), dtype=np.int64)  # tokens matched, ending at the candidate
    alive = np.ones(len(row_of), dtype=bool)
    for back in range(1, max_match):
        source, target = end_of - back, last[row_of] - back
        alive &= (source >= 0) & (target >= 0)
        alive[alive] = context[row_of[alive], source[alive]] == context[row_of[alive], target[alive]]
        if not alive.any():
            break
        run += alive
    best = np.zeros(len(rows), dtype=np.int64)
    np.maximum.at(best, row_of, run)
    longest = run == best[row_of]
    end = np.full(len(rows), -1 if most_recent else width, dtype=np.int64)
    (np.maximum if most_recent else np.minimum).at(end, row_of[longest], end_of[longest])
    end = np.minimum(np.maximum(end, 0), width - 1)  # rows without a candidate: zeroed below
    count = np.minimum(np.minimum(k, last - end), max_model_len - 1 - context_lengths)
    count = np.where(best >= MIN_MATCH, np.maximum(count, 0), 0)
    offsets = np.arange(k)
    taken = np.take_along_axis(context, np.minimum(end[:, None] + 1 + offsets, width - 1), axis=1)
    tokens[:] = np.where(offsets < count[:, None], taken, 0)
    return NgramProposals(tokens, count, np.where(count > 0, best, 0))


def expected_accepted(conditional: np.ndarray) -> np.ndarray:
    """[R, K] conditional confidences -> [R] expected accepted drafts (sum of prefix survival)."""
    return np.cumprod(conditional, axis=1).sum(axis=1)


def match_buckets(matches: np.ndarray) -> np.ndarray:
    """Match lengths -> the buckets their acceptance is learned in."""
    return np.minimum(np.maximum(np.asarray(matches) - MIN_MATCH, 0), MATCH_BUCKETS - 1)


def continuation_keys(proposals: NgramProposals) -> np.ndarray:
    """[R] each request's `CONTINUATION_KEYS` index: 0 without a continuation, else 1 + its
    match bucket."""
    return np.where(proposals.lengths > 0, 1 + match_buckets(proposals.matches), 0)


def conditional_from_table(table: np.ndarray, matches: np.ndarray, lengths: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """[R, width] conditional confidences of n-gram proposals read from a learned
    [mode, match bucket, position] table (0 beyond each proposal's length)."""
    rows = table[np.where(greedy, 0, 1), match_buckets(matches)]
    return np.where(np.arange(table.shape[-1]) < np.asarray(lengths)[:, None], rows, 0.0)


@dataclass
class NgramConfidence:
    """Conditional acceptance of n-gram drafts, per sampling mode, match bucket and
    position: (accepted + 1) / (judged + 2), with the counts decayed by `forgetting`
    each observed step so the estimate follows the traffic."""

    width: int
    forgetting: float = 0.999
    accepted: np.ndarray = field(init=False)
    judged: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (len(SAMPLING_MODES), MATCH_BUCKETS, self.width)
        self.accepted = np.zeros(shape)
        self.judged = np.zeros(shape)

    def table(self) -> np.ndarray:
        """[mode, match bucket, position] conditional acceptance as learned so far."""
        return (self.accepted + 1.0) / (self.judged + 2.0)

    def conditional(self, matches: np.ndarray, lengths: np.ndarray, greedy: np.ndarray) -> np.ndarray:
        """[R, width] conditional confidences of the proposals (0 beyond their length)."""
        return conditional_from_table(self.table(), matches, lengths, greedy)

    def observe(self, matches: np.ndarray, greedy: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Requests that verified `verified` n-gram drafts and had `accepted` of them
        accepted: positions < accepted were accepted, position `accepted` (if verified)
        was rejected, later ones were not judged."""
        if not len(verified):
            return
        self.accepted *= self.forgetting
        self.judged *= self.forgetting
        positions = np.arange(self.width)
        judged = positions < np.minimum(verified, accepted + 1)[:, None]
        hits = positions < np.asarray(accepted)[:, None]
        index = (np.where(greedy, 0, 1), match_buckets(matches))
        np.add.at(self.judged, index, judged)
        np.add.at(self.accepted, index, hits & judged)


def prefer_ngram(
    ngram_conditional: np.ndarray,
    first_confidence: np.ndarray,
    drafted_depth: int,
    mean_survival: np.ndarray | None,
) -> np.ndarray:
    """[R] True where the n-gram proposal expects more accepted tokens than the drafter's.

    The drafter's expectation is its calibrated first confidence c_1 times the shape of its
    recent mean prefix survival over the planned depth (positions 2.. relative to 1), so
    it reads nothing the drafter drew this step (see the module docstring)."""
    ngram = expected_accepted(ngram_conditional)
    if drafted_depth == 0:
        return ngram > 0.0
    return ngram > drafter_expected(first_confidence, drafted_depth, mean_survival)


def drafter_expected(first_confidence: np.ndarray, drafted_depth: int, mean_survival: np.ndarray | None) -> np.ndarray:
    """[R] expected accepted drafts of the drafter's block: its first confidence times the
    shape of its recent mean prefix survival over the depth (positions 2.. relative to 1)."""
    shape = np.ones(1)
    if mean_survival is not None and mean_survival[0] > 0.0:
        shape = np.minimum(mean_survival[:drafted_depth] / mean_survival[0], 1.0)
    return np.asarray(first_confidence) * shape.sum()


@dataclass(frozen=True)
class DrafterSkip:
    """The scheduler's word to the worker on leaving the drafter out of a step: once the
    step's tokens are sampled the worker looks up every request's continuation and, where
    the step is predicted to serve more tokens per second without the drafter's block than
    with it, only stores the drafter's context.

    The prediction weighs, as the depth choice does (controller.py), tokens against
    seconds. Without the drafter each request expects 1 + its continuation's learned
    acceptance and the pass verifies every continuation. With it, each request takes the
    larger of that and the drafter's expectation (its choice, `prefer_ngram`), and the
    step also pays the drafter's pass. This step's c_1 is not drawn yet, so the drafter's
    expectation is averaged over recent c_1 values: the choice is a maximum, and the mean
    c_1 alone would undervalue a drafter that is sometimes confident. Those values are
    kept apart by the request's situation (`continuation_keys`): where the context repeats
    itself the drafter is confident too, and c_1 pooled over all steps, most of them drawn
    where no continuation was found, would undervalue it exactly where the skip is weighed.
    (Measured: a rule that compared every continuation with the mean c_1 and ignored
    seconds skipped where a confident drafter would have won, benchmarks/results/
    ngram_skip_ab/. At one request on code, c_1 pooled left the drafter out of 35-37% of
    the steps, 2-4% behind never leaving it out; kept apart, 22%, 4% behind: within what
    two identical engines differ by; benchmarks/results/closed_loop/.)

    The decision reads the context and earlier steps only, never a draw, so
    verification stays exact (module docstring)."""

    table: np.ndarray  # [mode, match bucket, position] learned n-gram acceptance
    depth: int  # the planned draft depth
    drafter_expected: np.ndarray  # [CONTINUATION_KEYS, S] the block's expected accepted drafts, per recent c_1
    pass_seconds: np.ndarray  # [n] predicted seconds of the pass with n drafts beside the requests' own tokens
    drafting_seconds: float  # predicted drafting at the planned depth less storing the context alone

    def applies(self, proposals: NgramProposals, greedy: np.ndarray) -> bool:
        """True where the step is predicted to serve more tokens a second without the drafter."""
        requests = len(proposals.lengths)
        if not requests or not self.drafter_expected.shape[1]:
            return False
        conditional = conditional_from_table(self.table, proposals.matches, proposals.lengths, greedy)
        ngram = expected_accepted(conditional)  # [R]; 0 without a continuation
        drafter = self.drafter_expected[continuation_keys(proposals)].T  # [S, R]
        takes_drafter = drafter > ngram[None, :]
        with_tokens = requests + np.where(takes_drafter, drafter, ngram).sum(axis=1)
        with_drafts = np.where(takes_drafter, self.depth, proposals.lengths).sum(axis=1)
        with_seconds = self.seconds(with_drafts) + self.drafting_seconds
        without_seconds = self.seconds(np.array([proposals.lengths.sum()]))[0]
        return bool((requests + ngram.sum()) / without_seconds >= with_tokens.mean() / with_seconds.mean())

    def seconds(self, drafts: np.ndarray) -> np.ndarray:
        """Predicted seconds of the verification pass with `drafts` drafts in it."""
        return np.maximum(self.pass_seconds[np.minimum(drafts, len(self.pass_seconds) - 1)], 1e-9)
