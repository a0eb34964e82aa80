"""The hybrid drafter's tree: the prompt-lookup chain merged into the EAGLE-2 tree (no model needed)."""

from __future__ import annotations

import torch

from specgate.algorithms import ALGORITHMS
from specgate.decoding.sampling import SamplingParams
from specgate.speculative.drafter import DraftTree
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.hybrid import HybridDrafter, merge_chain
from specgate.speculative.ngram import NgramDrafter

# root -> 10 -> 11, root -> 20 -> 21 / 22
TREE = DraftTree(torch.tensor([10, 20, 11, 21, 22]), torch.tensor([-1, -1, 0, 1, 1]))


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


def test_chain_shares_the_trees_prefix_and_adds_only_new_nodes() -> None:
    merged = merge_chain(TREE, [20, 22, 7, 8])
    assert len(merged) == len(TREE) + 2  # 20 -> 22 already there
    assert _paths(merged) == _paths(TREE) | {(20, 22, 7), (20, 22, 7, 8)}
    assert merged.tokens[: len(TREE)].tolist() == TREE.tokens.tolist()  # the tree's order is kept


def test_disjoint_chain_hangs_under_the_root() -> None:
    merged = merge_chain(TREE, [5, 6])
    assert merged.parents.tolist()[len(TREE) :] == [-1, len(TREE)]
    assert merge_chain(TREE, []).tokens.tolist() == TREE.tokens.tolist()
    assert merge_chain(DraftTree.empty(), [5, 6]).is_chain


class _FixedTree(Eagle2Drafter):
    """Test-only: returns TREE's first k nodes and records the budgets it was given."""

    def __init__(self) -> None:
        self.budgets: list[int] = []

    def propose(self, tokens, features, k):  # noqa: ANN001, ANN201
        self.budgets.append(k)
        return DraftTree(TREE.tokens[:k], TREE.parents[:k])


def test_budget_split_and_node_limit() -> None:
    tree = _FixedTree()
    hybrid = HybridDrafter(tree, NgramDrafter())
    hybrid.begin([1], SamplingParams(), torch.Generator())
    tokens = [1, 2, 3, 9, 9, 9, 9, 9, 1, 2, 3]  # the tail 1 2 3 recurs: lookup drafts 9 9 9 ...
    for k in (0, 1, 2, 6, 13):  # 0: the generator's budget when the cache or max_tokens is used up
        out = hybrid.propose(tokens, torch.zeros(0, 4), k)
        assert len(out) <= k
        chain_k = max(0, min(ALGORITHMS["ngram"].default_k, k - 1))
        assert tree.budgets[-1] == k - chain_k
        if chain_k:
            assert (9,) * chain_k in _paths(out)
