"""Speculative sampling reproduces the target distribution (synthetic distributions, no model).

A two-level synthetic target: p0 for the first token, p1[x] for the token after x. Each trial drafts
a tree, verifies it, and records the first two emitted tokens (when only one is emitted, the second
is drawn from p1[first], which is what the next step would do). The pair counts must match
p0(a) * p1[a](b) by a chi-square test; a deliberately wrong verifier must fail the same test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from specgate.speculative.drafter import DraftTree
from specgate.speculative.verify import verify_greedy, verify_sampling
from tests.unit.stat_helpers import passes_chi2

V = 6
TRIALS = 12_000

Verifier = Callable[[DraftTree, Tensor, torch.Generator], tuple[list[int], int]]


def _dists(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Target (p0, p1) and a deliberately different draft (q0, q1)."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape: int) -> Tensor:
        return torch.softmax(torch.randn(*shape, V, generator=g), -1)

    return dist(), dist(V), dist(), dist(V)


def _sampled_chain(q0: Tensor, q1: Tensor, g: torch.Generator) -> DraftTree:
    a = int(torch.multinomial(q0, 1, generator=g))
    b = int(torch.multinomial(q1[a], 1, generator=g))
    return DraftTree.chain([a, b], torch.stack([q0, q1[a]]))


def _sampled_tree(q0: Tensor, q1: Tensor, g: torch.Generator) -> DraftTree:
    """3 root children drawn i.i.d. from q0 (repeats allowed), 2 children each i.i.d. from q1[child]."""
    firsts = torch.multinomial(q0, 3, replacement=True, generator=g).tolist()
    tokens, parents, qs = list(firsts), [-1] * 3, [q0] * 3
    for i, a in enumerate(firsts):
        tokens += torch.multinomial(q1[a], 2, replacement=True, generator=g).tolist()
        parents += [i, i]
        qs += [q1[a], q1[a]]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(qs))


def _topk_tree(q0: Tensor, q1: Tensor, g: torch.Generator) -> DraftTree:
    """Deterministic drafter (EAGLE-2 style): top-3 children of the root, top-2 under each; q = None."""
    firsts = q0.topk(3).indices.tolist()
    tokens, parents = list(firsts), [-1] * 3
    for i, a in enumerate(firsts):
        tokens += q1[a].topk(2).indices.tolist()
        parents += [i, i]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def _pair_counts(draft: Callable, verify: Verifier, seed: int) -> tuple[Tensor, Tensor]:
    p0, p1, q0, q1 = _dists(seed)
    g = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        tree = draft(q0, q1, g)
        probs = torch.cat([p0.unsqueeze(0), p1[tree.tokens]])  # row 1+i: target after node i
        path, bonus = verify(tree, probs, g)
        emitted = tree.tokens[path].tolist() + [bonus]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p1[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    return counts, p0.unsqueeze(1) * p1


def _accept_all(tree: DraftTree, probs: Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """WRONG on purpose: follows the first child to a leaf without any test, then samples p there."""
    children, path, row = tree.children(), [], 0
    while children[row]:
        path.append(children[row][0])
        row = path[-1] + 1
    return path, int(torch.multinomial(probs[row], 1, generator=gen))


DRAFTS = {"chain": _sampled_chain, "tree": _sampled_tree, "topk_tree": _topk_tree}


@pytest.mark.parametrize("shape", DRAFTS)
def test_sampling_matches_target(shape: str) -> None:
    assert passes_chi2(*_pair_counts(DRAFTS[shape], verify_sampling, seed=0))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_wrong_verifier_is_detected(shape: str) -> None:
    assert not passes_chi2(*_pair_counts(DRAFTS[shape], _accept_all, seed=0))


def test_greedy_follows_argmax_path_and_adds_bonus() -> None:
    # root -> {5, 7}; 7 -> {1}; 1 -> {}
    tree = DraftTree(torch.tensor([5, 7, 1]), torch.tensor([-1, -1, 1]))
    logits = torch.zeros(4, 10)
    logits[0, 7] = logits[2, 1] = logits[3, 4] = 1.0  # rows: root, node0, node1, node2
    assert verify_greedy(tree, logits) == ([1, 2], 4)
    logits[0, 7], logits[0, 3] = 0.0, 1.0
    assert verify_greedy(tree, logits) == ([], 3)


def test_tree_mask_and_positions() -> None:
    tree = DraftTree(torch.tensor([5, 7, 1, 2]), torch.tensor([-1, -1, 1, 2]))
    assert tree.depth.tolist() == [1, 1, 2, 3]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 13]
    mask = tree.attention_mask()
    assert mask[4].tolist() == [True, False, True, True, True]  # node 3 sees root, 1, 2, itself
    assert mask[1].tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
