"""The speculative engine's books: what drafting costs and buys, kept apart from the decoding loop.

Engine-wide (`EngineLedger`, one per generator): the live cost curve (cost_model/live.py), each
algorithm's drafting time (an EMA per node or per step, goodput.DraftCost) and what its drafted
steps cost beyond decode and drafting, above a plain step's own share (the tree walk, cutting
rejected cells, the drafter's accept: DraftCost.step_ms), and the acceptance the engine has seen
per (algorithm, drafter context), which every request starts from.

Per request (`RequestLedger`): its own acceptance per context, shrunk towards the engine's (at most
MAX_REQUEST_PRIOR_WEIGHT observations of it), each step's budget from them (goodput.choose_budget),
and what its steps bought on the curve: tokens emitted x cost(1) over the sum of cost(1 + nodes)
plus drafting time (`modelled_speedup`, which the gate's breaker reads). Closing it folds its
acceptance into the engine's. Like llama.cpp's per-implementation counters in
common/speculative.cpp, the loop only reports what happened; the arithmetic lives here.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.goodput import PRIOR_WEIGHT, Acceptance, CostCurve, DraftCost, WarmMean, choose_budget, ema
from specgate.cost_model.live import LiveCurve

MAX_REQUEST_PRIOR_WEIGHT = 32.0  # the most of the engine's evidence a request's acceptance starts with
ENGINE_MEMORY = 0.98  # weight of earlier requests in the engine-wide acceptance each request starts from


class EngineLedger:
    def __init__(self, algorithms: Iterable[str], curve: CostCurve | None = None) -> None:
        self.curve: LiveCurve | None = None
        self.set_curve(curve)
        self.draft_cost = {name: DraftCost(per_node=ALGORITHMS[name].draft_cost_per_node) for name in algorithms}
        self.acceptance: dict[tuple[str, int], Acceptance] = {}
        # EMA of a plain step's time beyond its decode (sampling, the books): a drafted step's own
        # extra is counted above this (DraftCost.step_ms)
        self.plain_extra_ms = 0.0
        # EMA per algorithm of a catch-up's time per unit of Drafter.backlog (Drafter.catchup_ms):
        # EAGLE's head feeding on target features, a draft model on tokens, of the prompt or of
        # plain steps, when it drafts again; None until the algorithm first caught up
        self.catchup_ms_per_unit = {name: WarmMean() for name in algorithms}
        self._explore = random.Random(0)  # the budget's posterior draws (choose_budget); never a request's generator

    def set_curve(self, curve: CostCurve | None) -> None:
        """Start from a (new) calibration: what was learned of the old one is dropped. Without a
        curve every step drafts the request's k (exactness tests)."""
        self.curve = None if curve is None else LiveCurve(curve)

    def engine_acceptance(self, algorithm: str, context: int) -> Acceptance:
        key = (algorithm, context)
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(prior=[ALGORITHMS[algorithm].prior(context)])
        return self.acceptance[key]

    def request(self, algorithm: str, k: int) -> RequestLedger:
        return RequestLedger(self, algorithm, k)


class RequestLedger:
    def __init__(self, engine: EngineLedger, algorithm: str, k: int) -> None:
        self.engine, self.algorithm, self.k = engine, algorithm, k
        self._acceptance: dict[int, Acceptance] = {}
        self._plain_ms = self._spent_ms = 0.0  # what plain decoding would have cost, and what the steps cost

    def acceptance(self, context: int) -> Acceptance:
        """This request's acceptance in a drafter context, starting from what the engine has seen."""
        if context not in self._acceptance:
            engine = self.engine.engine_acceptance(self.algorithm, context)
            positions = range(max(self.k, 1))
            self._acceptance[context] = Acceptance(
                prior=[engine.rate(i) for i in positions],
                weight=[min(PRIOR_WEIGHT + (engine.tries[i] if i < len(engine.tries) else 0.0), MAX_REQUEST_PRIOR_WEIGHT)
                        for i in positions],
            )
        return self._acceptance[context]

    def budget(self, context: int, unseen: int = 0, tokens_left: int = 1) -> int:
        """Draft nodes for the next step: the budget of highest expected goodput, 0 included (k
        without a curve). `unseen`: what the drafter would catch up on first (Drafter.backlog), a cost
        that enables the request's remaining steps, so spread over its `tokens_left`."""
        curve = self.engine.curve
        if curve is None:
            return self.k
        debt = (self.engine.catchup_ms_per_unit[self.algorithm].value or 0.0) * unseen / max(tokens_left, 1)
        return choose_budget(
            curve, self.acceptance(context), self.engine.draft_cost[self.algorithm], self.k, ALGORITHMS[self.algorithm].depth,
            self.engine._explore, debt,
        )

    def step(
        self, context: int, nodes: int, depth: int, accepted: int, drafting_ms: float, verify_ms: float, step_ms: float,
        catchup_ms: float = 0.0, caught_up: int = 0,
    ) -> float | None:
        """One verification: `nodes` drafted (0: a plain step) reaching `depth`, `accepted` of them
        accepted, the step's whole time `step_ms`; `drafting_ms` prices the nodes, `catchup_ms` is the
        drafter's catching up on earlier steps (Drafter.catchup_ms), counted in what the request spent
        only, and per unit of the `caught_up` ones for the next budgets. Returns the request's
        modelled speedup so far (None without a curve)."""
        engine, cost = self.engine, self.engine.draft_cost[self.algorithm]
        if catchup_ms > 0 and caught_up > 0 and not cost.pinned:
            engine.catchup_ms_per_unit[self.algorithm].add(catchup_ms / caught_up, cost.weight)
        extra = step_ms - verify_ms - drafting_ms - catchup_ms  # the step's own work beyond its decode and drafting
        if nodes:
            cost.record(drafting_ms, nodes, extra - engine.plain_extra_ms)
            self.acceptance(context).record(depth, accepted)
        else:
            engine.plain_extra_ms = ema(engine.plain_extra_ms, extra, cost.weight)
        curve = engine.curve
        if curve is None:
            return None
        curve.record_step(1 + nodes, verify_ms)
        self._plain_ms += (accepted + 1) * curve.cost(1)
        self._spent_ms += curve.cost(1 + nodes) + drafting_ms + catchup_ms + (max(cost.step_ms, 0.0) if nodes else 0.0)
        return self._plain_ms / self._spent_ms

    def close(self) -> None:
        """The request ended: its acceptance joins the engine's; a draft step still waiting for the
        plain step after it is counted as it was."""
        if self.engine.curve is not None:
            self.engine.curve.end_request()
        for context, acc in self._acceptance.items():
            self.engine.engine_acceptance(self.algorithm, context).merge(acc, ENGINE_MEMORY)
