"""The speculative algorithms, in one table: the gate, the engines, the policy schema and the benches read it.

`k` (num_speculative_tokens) is the draft budget per step: chain length for chains, node count for
trees. It is the most the engine drafts; its budget controller drafts less, down to nothing, where
the machine's cost curve says more does not pay. Requests above `max_k` are refused by the gate and
by the engine alike.

`prior_acceptance` is the per-position acceptance a request starts from before its own drafts are
verified (cost_model/goodput.py): a property of the model and drafter, not of the machine. The values
come from measured acceptance (docs/speculative.md, "Priors"); the engine replaces them with what it
observes as it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

SpecAlgorithm = Literal["eagle", "eagle2", "hybrid", "draft_model", "ngram"]


@dataclass(frozen=True)
class Algorithm:
    name: str
    default_k: int
    max_k: int
    needs_eagle_head: bool
    max_depth: int | None  # trees: the deepest position a draft reaches; None: a chain (depth = k)
    draft_cost_per_node: bool  # drafting time grows with each node (one drafter call per token)
    prior_acceptance: float
    # Priors by the drafter's context class (Drafter.context), where it has classes: index c-1.
    prior_by_context: tuple[float, ...] = ()

    def prior(self, context: int) -> float:
        return self.prior_by_context[context - 1] if 0 < context <= len(self.prior_by_context) else self.prior_acceptance

    def depth(self, nodes: int) -> int:
        """The deepest draft position `nodes` nodes reach: all of them in a chain, at most `max_depth`
        in a tree (whose extra nodes add candidates at each depth instead)."""
        return nodes if self.max_depth is None else min(nodes, self.max_depth)

    @property
    def default_depth(self) -> int:
        """The deepest position a draft of the default k reaches."""
        return self.depth(self.default_k)


EAGLE2_DEPTH = 5

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("eagle", default_k=5, max_k=10, needs_eagle_head=True, max_depth=None, draft_cost_per_node=True, prior_acceptance=0.42),
        Algorithm("eagle2", default_k=8, max_k=64, needs_eagle_head=True, max_depth=EAGLE2_DEPTH, draft_cost_per_node=False,
                  prior_acceptance=0.50),
        # the n-gram chain (5) merged into an eagle2 tree (k - 5 nodes)
        Algorithm("hybrid", default_k=13, max_k=69, needs_eagle_head=True, max_depth=EAGLE2_DEPTH, draft_cost_per_node=False,
                  prior_acceptance=0.62),
        Algorithm("draft_model", default_k=3, max_k=16, needs_eagle_head=False, max_depth=None, draft_cost_per_node=True,
                  prior_acceptance=0.07),
        # context = the length of the matched suffix (1-4): a one-token match is right far less often
        Algorithm("ngram", default_k=5, max_k=16, needs_eagle_head=False, max_depth=None, draft_cost_per_node=False, prior_acceptance=0.50,
                  prior_by_context=(0.25, 0.5, 0.55, 0.8)),
    )
}
SPEC_ALGORITHMS: tuple[str, ...] = get_args(SpecAlgorithm)
EAGLE_HEAD_ALGORITHMS: tuple[str, ...] = tuple(a.name for a in ALGORITHMS.values() if a.needs_eagle_head)
# The draft tree spec_engine's target must verify in one decode: the largest k of any algorithm.
MAX_TREE_NODES = max(a.max_k for a in ALGORITHMS.values())
assert set(SPEC_ALGORITHMS) == set(ALGORITHMS)


def check_k(algorithm: str, k: int | None) -> int:
    """The budget cap for a request: its k, or the algorithm's default. ValueError names the limit."""
    spec = ALGORITHMS.get(algorithm)
    if spec is None:
        raise ValueError(f"unknown speculative algorithm {algorithm!r}; choose one of {', '.join(SPEC_ALGORITHMS)}")
    if k is None:
        return spec.default_k
    if not 1 <= k <= spec.max_k:
        raise ValueError(f"num_speculative_tokens for {algorithm} must be in 1..{spec.max_k}, got {k}")
    return k
