"""Expected tokens per second of drafting: the cost curve, acceptance, and the choices made on them.

Shared by the speculative engine (each step's budget) and the gate (route, algorithm, breaker
thresholds), so the two decide with the same arithmetic. No torch here: the gate imports it.

How much to draft each step: the budget that maximises expected tokens per second (goodput).

For a budget of n draft nodes (a chain of n tokens, or a tree of n nodes):

    goodput(n) = (1 + E[accepted | n]) / (cost(n + 1) + draft_ms(n))        goodput(0) = 1 / cost(1)

`cost` is the engine's measured verification curve (cost_model/measure.py), `draft_ms` the drafter's
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

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, Field, model_validator

PRIOR_WEIGHT = 8.0  # how many observed positions the prior counts as


class CostCurve(BaseModel):
    """Median milliseconds per decode of `tokens[i]` tokens, at `context` cached tokens."""

    tokens: list[int] = Field(min_length=1)
    ms: list[float] = Field(min_length=1)
    context: int = 0
    measured: bool = True  # False: injected (tests, or an operator's override)
    floor_ms: float | None = None  # a bare loop of plain one-token decodes, measured beside the curve
    # the largest share of the machine's CPU that others took during a counted repetition (0: quiet;
    # above cost_model/quiet.MAX_OTHERS: the machine never was quiet enough, the curve is a best effort)
    others: float | None = None

    @model_validator(mode="after")
    def _shape(self) -> "CostCurve":
        if len(self.tokens) != len(self.ms) or self.tokens != sorted(set(self.tokens)) or self.tokens[0] != 1:
            raise ValueError("a cost curve needs increasing token counts starting at 1, one time each")
        if any(m <= 0 for m in self.ms):
            raise ValueError("cost curve times must be positive")
        return self

    def cost(self, t: int) -> float:
        """Milliseconds for a decode of `t` tokens: piecewise linear, extended linearly past the last point."""
        return interpolate(self.tokens, self.ms, t)

    def ratio(self, t: int) -> float:
        return self.cost(t) / self.cost(1)

    def table(self) -> str:
        return " ".join(f"{t}:{m:.1f}ms({m / self.ms[0]:.2f}x)" for t, m in zip(self.tokens, self.ms))

    @classmethod
    def of_ratios(cls, ratios: dict[int, float], base_ms: float = 10.0) -> "CostCurve":
        """An injected curve: cost(T) = base_ms * ratios[T]."""
        tokens = sorted(ratios)
        return cls(tokens=tokens, ms=[base_ms * ratios[t] for t in tokens], measured=False)


def interpolate(xs: list[int], ys: list[float], t: int) -> float:
    """Piecewise linear through (xs, ys), xs increasing from 1, extended linearly past the last point."""
    if len(xs) == 1:  # one point: assume every token costs the same
        return ys[0] * max(t, 1)
    if t <= 1:
        return ys[0]
    i = min(bisect.bisect_left(xs, t), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (t - x0) / (x1 - x0)


class Costs(Protocol):
    """What the budget controller reads: a measured CostCurve, or the engine's LiveCurve."""

    def cost(self, t: int) -> float: ...


@dataclass
class Acceptance:
    """Running per-position acceptance: hits[i] / tries[i] for position i+1, shrunk towards a prior.

    A position is tried when the tree reached it and every earlier position was accepted.
    """

    prior: list[float]  # a_i before any observation
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    # pseudo-observations behind prior[i] (PRIOR_WEIGHT where missing): a request starting from what
    # the engine has seen counts that evidence, so its draws (`rates`) are as sure as the engine is
    weight: list[float] = field(default_factory=list)

    def _counts(self, i: int) -> tuple[float, float]:
        """(accepted, rejected) at position i+1, prior included: the Beta posterior's parameters."""
        p = self.prior[min(i, len(self.prior) - 1)]
        w = self.weight[min(i, len(self.weight) - 1)] if self.weight else PRIOR_WEIGHT
        h, t = (self.hits[i], self.tries[i]) if i < len(self.tries) else (0.0, 0.0)
        return h + w * p, (t - h) + w * (1 - p)

    def rate(self, i: int) -> float:
        """a_{i+1}: acceptance at position i+1 given position i was accepted (the posterior mean)."""
        a, b = self._counts(i)
        return a / (a + b)

    def rates(self, depth: int, rng: random.Random | None = None) -> list[float]:
        """a_1..a_depth: the posterior means, or with `rng` one draw from each position's Beta posterior."""
        if rng is None:
            return [self.rate(i) for i in range(depth)]
        return [rng.betavariate(*(max(c, 1e-3) for c in self._counts(i))) for i in range(depth)]

    def record(self, depth: int, accepted: int) -> None:
        """One verified draft whose deepest node was at `depth`, with `accepted` positions accepted."""
        need = depth - len(self.tries)
        if need > 0:
            self.hits += [0.0] * need
            self.tries += [0.0] * need
        for i in range(min(accepted + 1, depth)):
            self.tries[i] += 1
            self.hits[i] += i < accepted

    def expected(self, depth: int, rng: random.Random | None = None) -> list[float]:
        """E[accepted] for drafts reaching depth 0..`depth` (at one posterior draw, given `rng`)."""
        out, reach, total = [0.0], 1.0, 0.0
        for a in self.rates(depth, rng):
            reach *= a
            total += reach
            out.append(total)
        return out

    def merge(self, other: "Acceptance", decay: float) -> None:
        """Fold a finished request's counts into an engine-wide one (older counts decay)."""
        n = max(len(self.tries), len(other.tries))
        self.hits = [decay * (self.hits[i] if i < len(self.hits) else 0.0) + (other.hits[i] if i < len(other.hits) else 0.0)
                     for i in range(n)]
        self.tries = [decay * (self.tries[i] if i < len(self.tries) else 0.0) + (other.tries[i] if i < len(other.tries) else 0.0)
                      for i in range(n)]


def ema(mean: float, sample: float, weight: float) -> float:
    """An exponential moving average's next value: `sample` counts `weight`, the history the rest."""
    return (1 - weight) * mean + weight * sample


@dataclass(slots=True)
class WarmMean:
    """An EMA, warmed up: the plain mean of the samples while they number fewer than 1/weight, the
    EMA after; with the count of samples behind it, which the thresholds that want a few samples
    before they judge read too. Why not seed the EMA with the first sample: a seeded EMA of weight 0.1
    is still more than half its first sample after six more, so one odd first request (a warm-up
    asking for 8 tokens, which drafted nothing and bought a gain of 1.0) decided a breaker's
    five-probe verdict against the probes that paid (docs/gate.md, "Circuit breaker")."""

    value: float | None = None  # None before the first sample
    samples: int = 0

    def add(self, sample: float, weight: float) -> None:
        self.value = sample if self.value is None else ema(self.value, sample, max(weight, 1.0 / (self.samples + 1)))
        self.samples += 1


@dataclass
class DraftCost:
    """The drafter's measured time: per node for chain drafters (one call per token), per step for
    trees; and what a drafted step costs beyond its decode and its drafting, above a plain step's
    own share (walking the tree, cutting the rejected cells from the cache, the drafter's accept)."""

    per_node: bool
    ms: float = 0.0  # EMA: ms per node, or ms per step
    weight: float = 0.2
    pinned: bool = False  # set by a calibration override: drafts do not update it
    step_ms: float = 0.0  # EMA: the drafted step's own extra, learned from the engine's steps

    def record(self, elapsed_ms: float, nodes: int, step_extra_ms: float | None = None) -> None:
        if nodes <= 0 or self.pinned:
            return
        sample = elapsed_ms / nodes if self.per_node else elapsed_ms
        self.ms = sample if self.ms == 0.0 else ema(self.ms, sample, self.weight)
        if step_extra_ms is not None:  # unclipped, so that timing noise averages out
            self.step_ms = ema(self.step_ms, step_extra_ms, self.weight)

    def __call__(self, n: int) -> float:
        return 0.0 if n == 0 else self.ms * (n if self.per_node else 1) + max(self.step_ms, 0.0)


Depth = Callable[[int], int]  # nodes -> the deepest position they reach (specgate.algorithms.Algorithm.depth)


def choose_budget(
    curve: Costs, acceptance: Acceptance, draft_ms: DraftCost, max_budget: int, depth: Depth, rng: random.Random | None = None,
    fixed_ms: float = 0.0,
) -> int:
    """The budget in [0, max_budget] with the highest expected goodput.

    With `rng`, at one draw of the acceptance from its posterior (Thompson sampling) instead of its
    mean: a drafter context the engine knows little about is then tried now and then, and only
    drafts that are made teach the acceptance and the live cost curve anything. As evidence builds
    up, the draws concentrate and the choice becomes the greedy one; output tokens are the same
    either way (verification is lossless whatever the budget).

    A tie between drafting budgets goes to the larger one: a tree's nodes past its depth add
    candidates at each depth, which this model does not credit, and they cost nothing when the curve
    says so. Drafting at all must pay strictly more than a plain step. `fixed_ms` is what drafting
    now costs whatever the budget (a drafter's catch-up on the steps it skipped, spread over the
    request's remaining steps: cost_model/ledger.py).
    """
    expected = acceptance.expected(depth(max_budget), rng)
    plain = 1.0 / curve.cost(1)
    best, best_goodput = 0, plain
    for n in range(1, max_budget + 1):
        goodput = (1.0 + expected[depth(n)]) / (curve.cost(n + 1) + draft_ms(n) + fixed_ms)
        if goodput > plain * (1 + 1e-9) and goodput >= best_goodput * (1 - 1e-9):
            best, best_goodput = n, goodput
    return best


def expected_speedup(curve: CostCurve, draft_ms: DraftCost, alpha: float, max_budget: int, depth: Depth) -> tuple[float, int]:
    """(best speedup over plain decoding when drafting, its budget) at per-position acceptance `alpha`.

    Budgets 1..max_budget only: what drafting is expected to buy. The engine itself also has budget
    0, a plain step, so a request it serves is not expected slower than plain decoding.
    """
    expected = Acceptance(prior=[alpha]).expected(depth(max_budget))
    base = curve.cost(1)
    best, best_n = 0.0, 0
    for n in range(1, max_budget + 1):
        speedup = base * (1.0 + expected[depth(n)]) / (curve.cost(n + 1) + draft_ms(n))
        if speedup > best:
            best, best_n = speedup, n
    return best, best_n


def _bisect(f, target: float) -> float:  # noqa: ANN001
    """x in [0, 1] with f(x) = target, for f increasing."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def break_even_alpha(curve: CostCurve, draft_ms: DraftCost, max_budget: int, depth: Depth) -> float | None:
    """The per-position acceptance above which drafting pays (None: it does not pay even at 1)."""
    if expected_speedup(curve, draft_ms, 1.0, max_budget, depth)[0] <= 1.0:
        return None
    return _bisect(lambda a: expected_speedup(curve, draft_ms, a, max_budget, depth)[0], 1.0)


def rate_of_alpha(alpha: float, depth: int) -> float:
    """accepted / drafted for a chain of `depth` at per-position acceptance `alpha` (what the gate's EMA tracks)."""
    return Acceptance(prior=[alpha]).expected(depth)[-1] / depth


def alpha_of_rate(rate: float, depth: int) -> float:
    """The per-position acceptance whose chain of `depth` is accepted at `rate` (inverse of rate_of_alpha)."""
    return _bisect(lambda a: rate_of_alpha(a, depth), min(max(rate, 0.0), 1.0))
