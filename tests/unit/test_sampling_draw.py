"""sampling.draw, the one draw from a distribution that the engines and the verifier share."""

from __future__ import annotations

import torch

from specgate.decoding.sampling import draw
from tests.unit.stat_helpers import passes_chi2


def test_draws_follow_the_distribution_and_never_a_zero_cell() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(probs))
    for _ in range(20000):
        counts[draw(probs, gen)] += 1
    assert counts[probs == 0].sum() == 0
    assert passes_chi2(counts, probs)
    skewed = torch.tensor([0.5, 0.0, 0.0, 0.5])  # a wrong index shift shows at once
    assert not passes_chi2(counts[:4], skewed)


def test_scale_is_irrelevant_and_the_last_cell_is_reachable() -> None:
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    probs = torch.tensor([0.1, 0.3, 0.6])
    assert [draw(probs, gen_a) for _ in range(200)] == [draw(probs * 7.0, gen_b) for _ in range(200)]
    only_last = torch.tensor([0.0, 0.0, 1.0])
    gen = torch.Generator().manual_seed(1)
    assert {draw(only_last, gen) for _ in range(500)} == {2}


def test_a_large_vocabulary_matches_its_distribution() -> None:
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * 3
    probs = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(len(probs))
    for _ in range(30000):
        counts[draw(probs, gen)] += 1
    assert passes_chi2(counts, probs)
