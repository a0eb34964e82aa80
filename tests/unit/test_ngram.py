"""The n-gram drafter's index finds exactly what a scan of the whole context finds."""

from __future__ import annotations

import random

import torch

from specgate.decoding.sampling import SamplingParams
from specgate.speculative.ngram import NgramDrafter


def scan(tokens: list[int], max_n: int, min_n: int) -> tuple[int, int]:
    """The definition: the longest suffix (<= max_n) seen before, at its latest earlier start."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s : s + n] == tail:
                return n, s
    return 0, 0


def test_index_matches_a_full_scan_as_tokens_grow() -> None:
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([3, 6, 20])  # small vocabularies: many repeats, matches of every length
        max_n, min_n = rng.choice([(4, 1), (3, 2), (1, 1)])
        d = NgramDrafter(prompt_lookup_max=max_n, prompt_lookup_min=min_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        d.begin(list(tokens), SamplingParams(), torch.Generator())
        for _ in range(60):
            want = scan(tokens, max_n, min_n)
            assert d._match(tokens) == want, (trial, tokens)
            n, s = want
            tree = d.propose(tokens, torch.empty(0), 3)
            assert tree.tokens.tolist() == (tokens[s + n : s + n + 3] if n else [])
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 4]))]  # a step's accepted + bonus


def test_begin_forgets_the_previous_request() -> None:
    d = NgramDrafter()
    d.begin([1, 2, 3, 1, 2], SamplingParams(), torch.Generator())
    assert d.context([1, 2, 3, 1, 2]) == 2
    d.begin([7, 8], SamplingParams(), torch.Generator())
    assert d.context([7, 8, 9]) == 0
