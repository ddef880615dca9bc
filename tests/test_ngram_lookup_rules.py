"""benchmarks/ngram_lookup_rules.py on hand-made text: rules told apart by what they copy."""

from __future__ import annotations

import numpy as np

from tests.benchmark_scripts import load_benchmark


def test_the_most_recent_occurrence_copies_a_revised_passage_that_the_earliest_misses():
    """`a b c d` first continues `1 2 3`, later (revised) `7 8 9`, and the text goes on as
    revised: at the third `a b c d` ours copies `7 8 9`, vLLM's rule `1 2 3`."""
    rules = load_benchmark("ngram_lookup_rules")
    first, revised = [11, 12, 13, 14, 1, 2, 3], [11, 12, 13, 14, 7, 8, 9]
    tokens = np.array([5, 6, *first, 40, *revised, 41, 11, 12, 13, 14, 7, 8, 9, 42])
    at = np.array([len(tokens) - 4])  # the context ends with the third `a b c d`
    truth = tokens[at[0]: at[0] + rules.K]
    truth = np.r_[truth, np.full(rules.K - len(truth), -1)][None, :]
    scored = {name: rules.accepted(*rule(tokens, at), truth)[0] for name, rule in rules.rules([]).items()}
    assert scored == {"vLLM: earliest, longest match up to 4": 0, "vLLM's rule, longest match up to 8": 0,
                      "ours: most recent, longest match up to 8": 3}


def test_matching_further_finds_the_longer_context():
    """Two earlier occurrences of the last 2 tokens, only one of them preceded by the same 4:
    matching up to 2 takes the most recent (wrong) one, up to 8 the longer match."""
    rules = load_benchmark("ngram_lookup_rules")
    tokens = np.array([1, 2, 3, 4, 30, 31, 9, 3, 4, 50, 51, 8, 1, 2, 3, 4, 30, 31])
    at = np.array([len(tokens) - 2])  # context ends with `1 2 3 4`
    truth = np.array([[30, 31, -1, -1, -1, -1, -1]])
    short, long = rules.lookup(2), rules.lookup(8)
    assert rules.accepted(*short(tokens, at), truth)[0] == 0  # `3 4` last seen before `50 51`
    assert rules.accepted(*long(tokens, at), truth)[0] == 2
