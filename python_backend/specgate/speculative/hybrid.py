"""Hybrid (SAM-Decoding style): the prompt-lookup chain merged into the EAGLE-2 tree, one verification.

Prompt lookup wins where the reply copies its context (summarization, code) and the EAGLE head where
it does not; one tree holds both, so each step keeps whichever is right. `k` is the total node
budget: the n-gram chain gets up to its own default (5) and the tree the rest (8 at the default 13,
EAGLE-2's measured best). The chain is walked from the root and shares any prefix the tree already
has, so a step never verifies a token twice at one node.

Both parts draft deterministically (q is None), so the multi-candidate verifier stays exact at any
temperature. Neither part keeps draft state to roll back (EAGLE re-feeds the committed features
on the next `propose`), so `accept` has nothing to do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.algorithms import ALGORITHMS
from specgate.decoding.sampling import SamplingParams
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.ngram import NgramDrafter

CHAIN_K = ALGORITHMS["ngram"].default_k


class HybridDrafter(Drafter):
    name = "hybrid"
    uses_features = True

    def __init__(self, tree: Eagle2Drafter, lookup: NgramDrafter, chain_k: int = CHAIN_K) -> None:
        self.tree, self.lookup, self.chain_k = tree, lookup, chain_k

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        super().begin(prompt_ids, params, gen)
        self.tree.begin(prompt_ids, params, gen)
        self.lookup.begin(prompt_ids, params, gen)

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        chain_k = max(0, min(self.chain_k, k - 1))  # k = 0 (no room left): neither part drafts
        # The tree drafter runs every step even with a small budget: it consumes the new features.
        tree = self.tree.propose(tokens, features, k - chain_k)
        self.catchup_ms = self.tree.catchup_ms
        chain = self.lookup.propose(tokens, features, chain_k).tokens.tolist() if chain_k > 0 else []
        return merge_chain(tree, chain)


def merge_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """`tree` plus `chain` hung under the root, reusing the tree's nodes along a shared prefix."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    node = -1
    for t in chain:
        if (node, t) not in children:
            children[node, t] = len(tokens)
            tokens.append(t)
            parents.append(node)
        node = children[node, t]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
