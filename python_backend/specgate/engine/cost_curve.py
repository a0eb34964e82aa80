"""The machine's verification cost curve: how long one target decode of T tokens takes.

Whether speculation pays depends on cost(T) / cost(1). Where verifying 8 tokens costs about as much
as 1 (a CPU with native bf16 running PyTorch), drafting 8 pays even at low acceptance; where it costs
8 times as much (llama.cpp on an AVX2-only CPU), almost nothing does. So the speculative engine
measures its own curve at load (`measure`), and the budget controller and the gate read it.
"""

from __future__ import annotations

import bisect
import random
import statistics
import time

from pydantic import BaseModel, Field, model_validator

from specgate.engine.target import Target
from specgate.engine.tree import DraftTree

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens per decode (root + draft nodes)


class CostCurve(BaseModel):
    """Median milliseconds per decode of `tokens[i]` tokens, at `context` cached tokens."""

    tokens: list[int] = Field(min_length=1)
    ms: list[float] = Field(min_length=1)
    context: int = 0
    measured: bool = True  # False: injected (tests, or an operator's override)

    @model_validator(mode="after")
    def _shape(self) -> "CostCurve":
        if len(self.tokens) != len(self.ms) or self.tokens != sorted(set(self.tokens)) or self.tokens[0] != 1:
            raise ValueError("a cost curve needs increasing token counts starting at 1, one time each")
        if any(m <= 0 for m in self.ms):
            raise ValueError("cost curve times must be positive")
        return self

    def cost(self, t: int) -> float:
        """Milliseconds for a decode of `t` tokens: piecewise linear, extended linearly past the last point."""
        xs, ys = self.tokens, self.ms
        if len(xs) == 1:  # one point: assume every token costs the same
            return ys[0] * max(t, 1)
        if t <= 1:
            return ys[0]
        i = min(bisect.bisect_left(xs, t), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (t - x0) / (x1 - x0)

    def ratio(self, t: int) -> float:
        return self.cost(t) / self.cost(1)

    def table(self) -> str:
        return " ".join(f"{t}:{m:.1f}ms({m / self.ms[0]:.2f}x)" for t, m in zip(self.tokens, self.ms))

    @classmethod
    def of_ratios(cls, ratios: dict[int, float], base_ms: float = 10.0) -> "CostCurve":
        """An injected curve: cost(T) = base_ms * ratios[T]."""
        tokens = sorted(ratios)
        return cls(tokens=tokens, ms=[base_ms * ratios[t] for t in tokens], measured=False)


def measure(target: Target, slot: int, sizes: tuple[int, ...] = SIZES, context: int = 256, reps: int = 5, seed: int = 0) -> CostCurve:
    """Time one verification decode of each size (root + a chain) on `slot`, which is left released.

    Sizes are interleaved within each repetition so that machine noise spreads over all of them;
    each decode is committed as the root alone, so the context grows by one token per decode.
    """
    rng = random.Random(seed)
    vocab = target.info.vocab_size
    context = min(context, target.info.max_context - max(sizes) - reps * len(sizes) - 1)
    times: dict[int, list[float]] = {t: [] for t in sizes}
    try:
        target.prefill(slot, [rng.randrange(vocab) for _ in range(context)], features=False)
        for rep in range(reps + 1):  # the first repetition warms caches and allocations, not counted
            for t in sizes:
                tree = DraftTree.chain([rng.randrange(vocab) for _ in range(t - 1)])
                start = time.perf_counter()
                target.verify(slot, rng.randrange(vocab), tree, features=False)
                elapsed = time.perf_counter() - start
                target.commit(slot, [0])
                if rep:
                    times[t].append(1000 * elapsed)
    finally:
        target.release(slot)
    return CostCurve(tokens=list(sizes), ms=[statistics.median(times[t]) for t in sizes], context=context)
