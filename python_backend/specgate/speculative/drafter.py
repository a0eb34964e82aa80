"""The drafter interface and the draft tree every drafter returns.

A chain is a tree with one child per node, so the verifier and the generator handle one shape.
Node order is topological (a parent comes before its children), and children of one node are tried
by the verifier in node order, so a drafter lists its most likely candidates first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from specgate.engine.sampling import SamplingParams


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


class Drafter(ABC):
    """Proposes draft tokens after the last accepted token; one request at a time.

    Lifecycle per request: `begin`, then per step `propose` -> (target verifies) -> `accept`.
    `tokens` passed to `propose` are all committed tokens (prompt + output); the last one is the root,
    which the target has not run yet. `features` are the target's final hidden states [F, D] for the
    F positions committed since the previous `propose` (excluding the root): drafters that read
    features (EAGLE) consume them, the others ignore them.
    """

    name: ClassVar[str]
    default_k: ClassVar[int]
    max_k: ClassVar[int]  # upper bound for k; a tree never has more than k nodes

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        """Reset per-request state. Sampling drafters draw with `params` and `gen`."""
        self.params, self.gen = params, gen

    @abstractmethod
    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        """Draft at most `k` nodes rooted at `tokens[-1]`."""

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        """`path` = accepted node indices, root to leaf. Stateful drafters roll their caches back."""
