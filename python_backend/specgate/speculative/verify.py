"""Lossless verification of a draft tree against the target's distributions at (root, nodes).

Both functions walk the tree from the root and return `(path, bonus)`: the accepted node indices,
root to leaf, and one more token drawn from the target where the walk stopped, so every step emits
`len(path) + 1` tokens. Row 0 of `logits`/`probs` is the target's next-token distribution after the
root, row `1 + i` after node `i`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specgate.decoding.sampling import draw, greedy_tokens
from specgate.speculative.drafter import DraftTree


def verify_greedy(tree: DraftTree, logits: np.ndarray) -> tuple[list[int], int]:
    """Follow the child whose token is the target's argmax; the argmax where none matches is the bonus."""
    best = greedy_tokens(logits)
    tokens, children = tree.tokens.tolist(), tree.children()
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in children[row] if tokens[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1


def verify_sampling(tree: DraftTree, probs: Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling (SpecInfer / EAGLE); for a chain, plain speculative sampling.

    At a node with target distribution p, try each child x ~ q in turn:
      accept with probability min(1, p(x) / q(x));
      on rejection continue with the residual p <- norm(max(0, p - q)).
    Each step is exact for independent draws (the accepted-or-residual token is distributed as p),
    so the output distribution equals sampling from the target. Deterministic drafts use q = one-hot,
    which reduces to "accept x with p(x), else drop x from p".
    """
    tokens, children = tree.tokens.tolist(), tree.children()
    path: list[int] = []
    row = 0
    while True:
        p = probs[row]
        accepted = None
        for c in children[row]:
            x = tokens[c]
            q = _one_hot(x, p) if tree.q is None else tree.q[c]
            if torch.rand((), generator=gen) * q[x] < p[x]:  # u < p/q without dividing by q
                accepted = c
                break
            p = _residual(p, q)
        if accepted is None:
            return path, draw(p, gen)
        path.append(accepted)
        row = accepted + 1


def _one_hot(x: int, like: Tensor) -> Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def _residual(p: Tensor, q: Tensor) -> Tensor:
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    # total == 0 only when p <= q everywhere, i.e. p == q: then rejection had probability 0
    # and this branch is reached by rounding alone; p itself is the right fallback.
    return r / total if total > 0 else p
