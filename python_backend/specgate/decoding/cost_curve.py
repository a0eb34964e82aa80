"""Measuring the machine's verification cost curve (specgate.goodput.CostCurve) on a target.

Whether speculation pays depends on cost(T) / cost(1). Where verifying 8 tokens costs about as much
as 1 (a CPU with native bf16 running PyTorch), drafting 8 pays even at low acceptance; where it costs
8 times as much (llama.cpp on an AVX2-only CPU), almost nothing does. So the speculative engine
measures its own curve at load, and the budget controller and the gate read it.
"""

from __future__ import annotations

import random
import statistics

from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.goodput import CostCurve

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens per decode (root + draft nodes)


def measure(target: Target, slot: int, sizes: tuple[int, ...] = SIZES, context: int = 256, reps: int = 5, seed: int = 0) -> CostCurve:
    """The median compute time of one verification decode of each size, as the engine pays for it.

    Every decode runs at `context` cached tokens (each is rolled back after). A T-token decode is
    timed between plain one-token steps, the pattern of a request that drafts now and then, and is
    charged what it makes the plain step after it cost above a steady plain step: llama.cpp reuses
    its compute graph only while the batch shape stays the same (specgate/live_curve.py counts the
    same way when serving). Sizes are interleaved within each repetition so that machine noise
    spreads over all of them; `slot` is left released.

    Each repetition also times a run of plain one-token decodes in a row (the steady graph of a bare
    decode loop): the floor, which cost(1) must agree with (speculative/calibrate.py checks).
    """
    rng = random.Random(seed)
    vocab = target.info.vocab_size
    context = min(context, target.info.max_context - max(sizes) - 1)

    def decode(t: int) -> float:
        target.verify(slot, rng.randrange(vocab), DraftTree.chain([rng.randrange(vocab) for _ in range(t - 1)]), features=False)
        target.commit(slot, [0])
        target.truncate(slot, context)
        return target.last_verify_ms

    samples: dict[int, list[float]] = {t: [] for t in sizes}
    floor: list[float] = []
    try:
        target.prefill(slot, [rng.randrange(vocab) for _ in range(context)], features=False)
        for rep in range(reps + 1):  # the first repetition warms caches and allocations, not counted
            steady = [decode(1) for _ in range(4)]
            if rep:
                floor.append(statistics.median(steady[1:]))
            for t in sizes:
                decode(1)  # back on the plain step's graph
                plain = decode(1)
                draft = decode(t)
                after = decode(1)
                if rep:
                    samples[t].append(plain if t == 1 else draft + after - plain)
    finally:
        target.release(slot)
    return CostCurve(
        tokens=list(sizes), ms=[max(statistics.median(samples[t]), 1e-3) for t in sizes], context=context, floor_ms=statistics.median(floor)
    )
