"""Does a request's own recent n-gram acceptance sharpen the n-gram confidences?

Replays the drafter's training corpus (SmolLM2's own samples at T = 0.7, never the
evaluation prompts) request by request through the hybrid's lookup
(`hybrid.lookup_continuations`) and its online confidence (`hybrid.NgramConfidence`): at
each step the request's continuation is looked up, scored, then judged against the tokens
the target really sampled next, and the request moves on past the accepted drafts and one
token of the target's own, as in the engine.

Why sampled text is the right judge: an n-gram draft is a point mass, so rejection sampling
accepts it with probability p(draft) and then continues from the target's distribution. The
target's own sample equals the draft with that same probability, so "the corpus token
equals the draft" is distributed like "verification accepts it", position after position.

Each step is scored twice, with the confidences pooled over histories (the form before the
history key) and keyed by the request's history, both read from the same table, learned
online exactly as the controller does (a quarter of the records warm it up first):

- log-loss per judged draft (lower is better calibrated and sharper);
- net value at a price per verified draft: verify every position whose prefix survival
  exceeds the price, count the accepted drafts less the price of those verified, per step.
  The price is what a verified draft costs in tokens of the pass's own throughput: about
  0.45 at four requests and 0.6-0.8 at sixteen on this CPU (step traces,
  `results/step_trace/`).

    python benchmarks/ngram_history.py --records 800 --out benchmarks/results/ngram_history
"""

from __future__ import annotations

import argparse
import json
import lzma
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_dspark.scheduling.hybrid import NgramConfidence, lookup_continuations

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "examples" / "drafters" / "corpus" / "smollm2-generated.jsonl.xz"
PRICES = (0.3, 0.45, 0.6, 0.75, 0.85)
FORMS = ("pooled", "history")


def records(domain: str, count: int) -> list[dict]:
    """The corpus' first `count` records of `domain`."""
    found = []
    with lzma.open(CORPUS, "rt") as file:
        for line in file:
            record = json.loads(line)
            if record["domain"] == domain:
                found.append(record)
                if len(found) == count:
                    break
    return found


def replay(domain: str, count: int, k: int) -> dict:
    """Log-loss and net value of both forms over the domain's records (module docstring)."""
    confidence = NgramConfidence(k)
    sampled = np.array([False])
    loss = dict.fromkeys(FORMS, 0.0)
    value = {form: np.zeros(len(PRICES)) for form in FORMS}
    steps = judged_drafts = 0
    chosen = records(domain, count)
    warm_up = len(chosen) // 4
    for index, record in enumerate(tqdm(chosen, desc=domain, unit="record")):
        req_id = record["id"]
        tokens = np.array(record["prompt_token_ids"] + record["response_token_ids"], dtype=np.int64)
        position = len(record["prompt_token_ids"])
        while position < len(tokens) - 1:
            proposal = lookup_continuations(tokens[None], np.array([position]), np.array([0]), k, 1 << 30)
            length = min(int(proposal.lengths[0]), len(tokens) - position)
            if not length:
                position += 1
                continue
            truth = tokens[position:position + length]
            accepted = int(np.argmin(np.append(proposal.tokens[0, :length] == truth, False)))
            history = confidence.history([req_id])
            if index >= warm_up:
                steps += 1
                judged_drafts += min(length, accepted + 1)
                for form in FORMS:
                    c = confidence.conditional(proposal.matches, np.array([length]), sampled,
                                               history if form == "history" else None)[0, :length]
                    judged = c[: min(length, accepted + 1)]
                    outcome = np.arange(len(judged)) < accepted
                    loss[form] -= float(np.log(np.where(outcome, judged, 1.0 - judged)).sum())
                    depths = (np.cumprod(c)[None, :] > np.array(PRICES)[:, None]).sum(axis=1)
                    value[form] += np.minimum(accepted, depths) - np.array(PRICES) * depths
            confidence.observe(proposal.matches, sampled, np.array([length]), np.array([accepted]), history, [req_id])
            position += accepted + 1
        confidence.forget(())
    return {"records": len(chosen), "scored_steps": steps, "judged_drafts": judged_drafts,
            "log_loss": {form: loss[form] / max(1, judged_drafts) for form in FORMS},
            "net_value": {form: dict(zip(map(str, PRICES), (value[form] / max(1, steps)).tolist())) for form in FORMS}}


def write_report(results: dict, meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "domains": results}, indent=1))
    lines = ["# N-gram confidences keyed by the request's recent acceptance", "",
             f"Replay of `examples/drafters/corpus/` (T = 0.7 samples of SmolLM2), K = {meta['k']}, the first "
             f"{meta['records']} records of each domain, the first quarter as warm-up; {meta['date']}. "
             "Net value: accepted drafts less the price of the verified ones, per n-gram step "
             "(`benchmarks/ngram_history.py`).", "",
             "| domain | scored steps | form | log-loss per judged draft | "
             + " | ".join(f"net value at price {p}" for p in PRICES) + " |",
             "|---|---|---|---|" + "---|" * len(PRICES)]
    for domain, row in results.items():
        for form in FORMS:
            cells = []
            for price in map(str, PRICES):
                net, pooled = row["net_value"][form][price], row["net_value"]["pooled"][price]
                gain = "" if form == "pooled" or pooled <= 0 else f" ({100 * (net / pooled - 1):+.0f}%)"
                cells.append(f"{net:.4f}{gain}")
            lines.append(f"| {domain} | {row['scored_steps']} | {form} | {row['log_loss'][form]:.4f} | "
                         + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", nargs="+", default=["code", "chat"])
    parser.add_argument("--records", type=int, default=800, help="per domain")
    parser.add_argument("--k", type=int, default=7, help="the longest continuation (num_speculative_tokens)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ngram_history")
    args = parser.parse_args()
    results = {domain: replay(domain, args.records, args.k) for domain in args.domains}
    meta = {"k": args.k, "records": args.records, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_report(results, meta, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
