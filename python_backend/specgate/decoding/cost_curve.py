"""Measuring the machine's verification cost curve (specgate.goodput.CostCurve) on a target.

Whether speculation pays depends on cost(T) / cost(1). Where verifying 8 tokens costs about as much
as 1 (a CPU with native bf16 running PyTorch), drafting 8 pays even at low acceptance; where it costs
8 times as much (llama.cpp on an AVX2-only CPU), almost nothing does. So the speculative engine
measures its own curve at load, and the budget controller and the gate read it.
"""

from __future__ import annotations

import random
import time

from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.goodput import CostCurve

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens per decode (root + draft nodes)


def measure(target: Target, slot: int, sizes: tuple[int, ...] = SIZES, context: int = 256, reps: int = 5, seed: int = 0) -> CostCurve:
    """Time one verification decode of each size (root + a chain) on `slot`, which is left released.

    Sizes are interleaved within each repetition so that machine noise spreads over all of them, and
    each size keeps its fastest time: other work on the machine (other models loading at start-up)
    only ever adds time. Each decode is committed as the root alone, so the context grows by one
    token per decode.
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
    return CostCurve(tokens=list(sizes), ms=[min(times[t]) for t in sizes], context=context)
