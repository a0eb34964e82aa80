"""A draft tree: what a drafter proposes and what the target verifies in one pass.

A chain is a tree with one child per node, so the verifier and the generator handle one shape.
Node order is topological (a parent comes before its children), and children of one node are tried
by the verifier in node order, so a drafter lists its most likely candidates first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """`tokens[i]` hangs under node `parents[i]` (-1 = the root: the last accepted token).

    `q[i]` is the distribution `tokens[i]` was *drawn* from, over the target vocabulary; it is what
    makes rejection sampling exact. `q is None` means the drafter chose its tokens deterministically
    (n-gram lookup, argmax, top-k), which the verifier treats as a one-hot q.
    """

    tokens: Tensor  # [N] long
    parents: Tensor  # [N] long
    q: Tensor | None = None  # [N, V] float32
    depth: Tensor = field(init=False)  # [N] long, 1 for children of the root

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.parents.numel() != n or (self.q is not None and self.q.shape[0] != n):
            raise ValueError("tokens, parents and q must have one entry per node")
        depth = torch.ones(n, dtype=torch.long)
        for i, p in enumerate(self.parents.tolist()):
            if p >= i:
                raise ValueError(f"node {i} has parent {p}: nodes must come after their parents")
            if p >= 0:
                depth[i] = depth[p] + 1
        self.depth = depth

    @classmethod
    def chain(cls, tokens: list[int] | Tensor, q: Tensor | None = None) -> "DraftTree":
        t = torch.as_tensor(tokens, dtype=torch.long)
        return cls(t, torch.arange(t.numel()) - 1, q)

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls.chain([])

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(len(self)) - 1).all())

    def children(self) -> list[list[int]]:
        """children()[0] lists the root's children, children()[1 + i] node i's, in node order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def attention_mask(self) -> Tensor:
        """[1+N, 1+N] bool over (root, nodes): each row sees itself and its ancestors."""
        n = len(self) + 1
        mask = torch.eye(n, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            mask[i + 1] |= mask[p + 1]
        return mask

    def positions(self, root_pos: int) -> Tensor:
        """[1+N] RoPE positions of (root, nodes): siblings share their depth's position."""
        return root_pos + torch.cat([torch.zeros(1, dtype=torch.long), self.depth])

    def branches(self) -> list[list[int]]:
        """One list per leaf: the nodes from the root's child down to that leaf, in leaf order."""
        parents = self.parents.tolist()
        inner = set(parents)
        out = []
        for leaf in (i for i in range(len(parents)) if i not in inner):
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            out.append(path[::-1])
        return out

    def depth_first(self) -> list[int]:
        """Node ids in depth-first preorder, children in node order (a parent before its subtree)."""
        children = self.children()
        out: list[int] = []
        stack = list(reversed(children[0]))
        while stack:
            node = stack.pop()
            out.append(node)
            stack += reversed(children[node + 1])
        return out
