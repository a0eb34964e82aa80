"""EAGLE-2: a dynamic draft tree grown by the head's cumulative confidence.

Expansion (depth steps): each frontier node gets its `top_k` most likely children, scored by the
sum of draft log-probabilities along the path; the `top_k` best of those become the next frontier.
Reranking: the `k` best-scored candidates of all depths form the tree. A child never outscores its
parent, so that set contains every selected node's ancestors.

Defaults (depth 5, top_k 4, k = total_tokens 8): docs/speculative.md, "EAGLE-2 tree size and the
hybrid split". The engine's budget controller may verify fewer nodes than k where the machine's
cost curve makes more not pay; a smaller budget keeps the k best-scored nodes.

Children are chosen deterministically (top-k), so the tree carries no q: the verifier treats each
as one-hot, which is exact at any temperature (a sampled tree would accept more when T > 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.algorithms import EAGLE2_DEPTH
from specgate.decoding.tree import DraftTree
from specgate.speculative.eagle import EagleBase
from specgate.speculative.eagle_head import EagleHead
from specgate.speculative.eagle_kernel import KernelEagleHead


class Eagle2Drafter(EagleBase):
    name = "eagle2"

    def __init__(self, head: EagleHead | KernelEagleHead, vocab_size: int, max_len: int, depth: int = EAGLE2_DEPTH, top_k: int = 4) -> None:
        super().__init__(head, vocab_size, max_len)
        self.depth, self.top_k = depth, top_k

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        root_feat = self._consume(tokens, features, k)[0, 0]
        if k == 0:
            return DraftTree.empty()
        tok: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        depth: list[int] = []

        def add_children(parents: list[int], logits: Tensor) -> list[int]:
            """Top-k children of each parent (rows of `logits`); returns the new candidates' ids."""
            lp, idx = torch.log_softmax(logits, -1).topk(self.top_k, -1)
            new = []
            for row, p in enumerate(parents):
                base, d = (score[p], depth[p] + 1) if p >= 0 else (0.0, 1)
                for v, t in zip(lp[row].tolist(), self.head.d2t[idx[row]].tolist()):
                    new.append(len(tok))
                    tok.append(t)
                    parent.append(p)
                    score.append(base + v)
                    depth.append(d)
            return new

        frontier = add_children([-1], self.head.draft_logits(root_feat).unsqueeze(0))
        feat: dict[int, Tensor] = {}  # predicted feature at an expanded node's position
        for _ in range(1, self.depth):
            # A child never outscores its parent: expanding a node below the k-th best score is wasted.
            if len(score) >= k:
                kth = sorted(score, reverse=True)[k - 1]
                frontier = [c for c in frontier if score[c] > kth]
                if not frontier:
                    break
            # The head's cache shows every cached entry to every new token, so the frontier's
            # ancestors are re-run in one block under a tree mask rather than cached per depth.
            block = sorted(_with_ancestors(frontier, parent))
            where = {c: j for j, c in enumerate(block)}
            inputs = torch.stack([feat[parent[c]] if parent[c] >= 0 else root_feat for c in block])
            mask = torch.eye(len(block), dtype=torch.bool)
            for j, c in enumerate(block):
                if parent[c] >= 0:
                    mask[j] |= mask[where[parent[c]]]
            out = self.head(
                inputs.unsqueeze(0),
                torch.tensor([[tok[c] for c in block]]),
                self.cache,
                self.cached,
                positions=torch.tensor([[self.cached + depth[c] - 1 for c in block]]),
                tree_mask=mask,
            )[0]
            for j, c in enumerate(block):
                feat[c] = out[j]
            children = add_children(frontier, self.head.draft_logits(out[[where[c] for c in frontier]]))
            frontier = sorted(children, key=lambda c: -score[c])[: self.top_k]

        chosen = sorted(range(len(tok)), key=lambda c: (-score[c], depth[c]))[:k]
        order = sorted(chosen, key=lambda c: (depth[c], -score[c]))  # parents first, likely children first
        index = {c: j for j, c in enumerate(order)}
        return DraftTree(
            torch.tensor([tok[c] for c in order]),
            torch.tensor([index[parent[c]] if parent[c] >= 0 else -1 for c in order]),
        )


def _with_ancestors(nodes: list[int], parent: list[int]) -> set[int]:
    out: set[int] = set()
    for c in nodes:
        while c >= 0 and c not in out:
            out.add(c)
            c = parent[c]
    return out
