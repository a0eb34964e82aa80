"""The speculative engine's cost curve, corrected by its own decodes as it serves.

A calibration measured once at load can be wrong in a way that measurement cannot see (on one
machine its one-token time was far above what plain decoding then cost, so drafts looked cheap and
the engine drafted at a loss: docs/engines.md, "Calibration"). So the engine times every
verification (compute only: waiting for the machine's compute lock is not cost) and the budget
controller reads this curve instead:

- cost(T) for a T the engine has verified is the median of its last `window` decodes, shrunk
  towards the calibration by `prior_decodes` pseudo-decodes (their weight fades as decodes come;
  the calibration is a median of five decodes, worth about two served ones);
- a T never verified keeps the calibration's value, interpolated between corrected points. The
  correction only comes from drafts that were made, so a curve that is too high errs towards plain
  decoding, never towards paying for drafts;
- a draft step is charged what it makes the next plain step cost above a plain step's: llama.cpp
  reuses its compute graph only while the batch shape stays the same, and re-plans it after a
  draft (docs/engines.md gives what that costs). `cost_model/measure.measure` counts the same way.

An injected curve (a test's, or an operator's override: `CostCurve.measured` False) is pinned.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

from specgate.cost_model.goodput import CostCurve, interpolate


class LiveCurve:
    def __init__(self, prior: CostCurve, window: int = 32, prior_decodes: float = 2.0) -> None:
        self.prior = prior
        self.pinned = not prior.measured
        self._window, self._prior_decodes = window, prior_decodes
        self._seen: dict[int, deque[float]] = {}
        self._count: dict[int, int] = {}
        self._xs: list[int] = list(prior.tokens)
        self._ys: list[float] = list(prior.ms)
        self._pending: tuple[int, float] | None = None  # a draft step waiting for the plain step after it

    def cost(self, t: int) -> float:
        return interpolate(self._xs, self._ys, t)

    def ratio(self, t: int) -> float:
        return self.cost(t) / self.cost(1)

    def record_step(self, tokens: int, ms: float) -> None:
        """One verification of `tokens` tokens (root + draft nodes) that took `ms` of compute."""
        if self.pinned:
            return
        pending, self._pending = self._pending, None
        if tokens > 1:
            if pending is not None:  # two draft steps in a row: the first had no plain step after it
                self._observe(*pending)
            self._pending = (tokens, ms)
        elif pending is None:
            self._observe(1, ms)
        else:  # the plain step after a draft: its excess over a plain step is the draft's doing
            self._observe(pending[0], pending[1] + ms - self.cost(1))

    def end_request(self) -> None:
        """The request ended: a draft step still waiting is recorded as it was."""
        if self._pending is not None:
            self._observe(*self._pending)
            self._pending = None

    def snapshot(self) -> CostCurve:
        """The current curve at the calibration's token counts (what the gauge and the gate read)."""
        return CostCurve(tokens=list(self.prior.tokens), ms=[self.cost(t) for t in self.prior.tokens], context=self.prior.context)

    def drift(self, other: CostCurve) -> float:
        """The largest factor by which this curve and `other` differ at the calibration's token counts."""
        return max(math.exp(abs(math.log(self.cost(t) / other.cost(t)))) for t in self.prior.tokens)

    def _observe(self, tokens: int, ms: float) -> None:
        seen = self._seen.setdefault(tokens, deque(maxlen=self._window))
        seen.append(ms)
        n = self._count[tokens] = self._count.get(tokens, 0) + 1
        w = self._prior_decodes
        value = max((w * self.prior.cost(tokens) + n * statistics.median(seen)) / (w + n), 1e-3)
        i = bisect.bisect_left(self._xs, tokens)
        if i < len(self._xs) and self._xs[i] == tokens:
            self._ys[i] = value
        else:
            self._xs.insert(i, tokens)
            self._ys.insert(i, value)
