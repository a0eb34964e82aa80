"""How much to draft each step: the budget that maximises expected tokens per second (goodput).

For a budget of n draft nodes (a chain of n tokens, or a tree of n nodes):

    goodput(n) = (1 + E[accepted | n]) / (cost(n + 1) + draft_ms(n))        goodput(0) = 1 / cost(1)

`cost` is the engine's measured verification curve (engine/cost_curve.py), `draft_ms` the drafter's
own measured drafting time, and E[accepted] comes from the request's running per-position
acceptance (`Acceptance`):

    E[accepted | n] = sum_{j=1..depth(n)} prod_{i<=j} a_i

where a_i is the probability that position i is accepted given position i-1 was, and depth(n) the
deepest position n nodes reach (n for a chain; at most the drafter's tree depth for a tree, whose
extra nodes raise the a_i instead). This is goodput-based draft-length control as in SmartSpec
(Liu et al., 2024). Budget 0 is a plain decode step on the same cache: a request never pays for
drafts that do not pay, and on a machine where verifying T tokens costs T times one token nothing
is drafted at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgate.engine.cost_curve import CostCurve

PRIOR_WEIGHT = 8.0  # how many observed positions the prior counts as


@dataclass
class Acceptance:
    """Running per-position acceptance: hits[i] / tries[i] for position i+1, shrunk towards a prior.

    A position is tried when the tree reached it and every earlier position was accepted.
    """

    prior: list[float]  # a_i before any observation
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)

    def rate(self, i: int) -> float:
        """a_{i+1}: acceptance at position i+1 given position i was accepted."""
        p = self.prior[min(i, len(self.prior) - 1)]
        h, t = (self.hits[i], self.tries[i]) if i < len(self.tries) else (0.0, 0.0)
        return (h + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT)

    def record(self, depth: int, accepted: int) -> None:
        """One verified draft whose deepest node was at `depth`, with `accepted` positions accepted."""
        need = depth - len(self.tries)
        if need > 0:
            self.hits += [0.0] * need
            self.tries += [0.0] * need
        for i in range(min(accepted + 1, depth)):
            self.tries[i] += 1
            self.hits[i] += i < accepted

    def expected(self, depth: int) -> list[float]:
        """E[accepted] for drafts reaching depth 0..`depth`."""
        out, reach, total = [0.0], 1.0, 0.0
        for i in range(depth):
            reach *= self.rate(i)
            total += reach
            out.append(total)
        return out

    def merge(self, other: "Acceptance", decay: float) -> None:
        """Fold a finished request's counts into an engine-wide one (older counts decay)."""
        n = max(len(self.tries), len(other.tries))
        self.hits = [decay * (self.hits[i] if i < len(self.hits) else 0.0) + (other.hits[i] if i < len(other.hits) else 0.0) for i in range(n)]
        self.tries = [decay * (self.tries[i] if i < len(self.tries) else 0.0) + (other.tries[i] if i < len(other.tries) else 0.0) for i in range(n)]


@dataclass
class DraftCost:
    """The drafter's measured time: per node for chain drafters (one call per token), per step for trees."""

    per_node: bool
    ms: float = 0.0  # EMA: ms per node, or ms per step
    weight: float = 0.2

    def record(self, elapsed_ms: float, nodes: int) -> None:
        if nodes <= 0:
            return
        sample = elapsed_ms / nodes if self.per_node else elapsed_ms
        self.ms = sample if self.ms == 0.0 else (1 - self.weight) * self.ms + self.weight * sample

    def __call__(self, n: int) -> float:
        return 0.0 if n == 0 else self.ms * (n if self.per_node else 1)


def choose_budget(curve: CostCurve, acceptance: Acceptance, draft_ms: DraftCost, max_budget: int, max_depth: int | None) -> int:
    """The budget in [0, max_budget] with the highest expected goodput (ties go to the smaller one)."""
    depth_of = (lambda n: n) if max_depth is None else (lambda n: min(n, max_depth))
    expected = acceptance.expected(depth_of(max_budget))
    best, best_goodput = 0, 1.0 / curve.cost(1)
    for n in range(1, max_budget + 1):
        goodput = (1.0 + expected[depth_of(n)]) / (curve.cost(n + 1) + draft_ms(n))
        if goodput > best_goodput * (1 + 1e-9):
            best, best_goodput = n, goodput
    return best


def expected_speedup(curve: CostCurve, acceptance_rate: float, draft_ms: DraftCost, max_budget: int) -> tuple[float, int]:
    """(best speedup over plain decoding, its budget) if each drafted node is accepted at
    `acceptance_rate` (accepted / drafted: what the gate's per-tenant EMA tracks)."""
    base = curve.cost(1)
    best, best_n = 1.0, 0
    for n in range(1, max_budget + 1):
        speedup = base * (1.0 + acceptance_rate * n) / (curve.cost(n + 1) + draft_ms(n))
        if speedup > best:
            best, best_n = speedup, n
    return best, best_n


def break_even_rate(curve: CostCurve, draft_ms: DraftCost, max_budget: int) -> float | None:
    """The lowest acceptance rate at which some budget beats plain decoding (None: none does, even at 1)."""
    base = curve.cost(1)
    rates = [(curve.cost(n + 1) + draft_ms(n) - base) / (n * base) for n in range(1, max_budget + 1)]
    best = min(rates, default=None)
    return None if best is None or best >= 1.0 else max(best, 0.0)
