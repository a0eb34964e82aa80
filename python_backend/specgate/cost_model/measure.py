"""Measuring: the machine's verification cost curve on a target, each drafter's drafting time, and
the calibration spec_engine publishes from both (at load, and whenever it is asked again).

Whether speculation pays depends on cost(T) / cost(1). Where verifying 8 tokens costs about as much
as 1 (a CPU with native bf16 running PyTorch), drafting 8 pays even at low acceptance; where it costs
8 times as much (llama.cpp on an AVX2-only CPU), almost nothing does. So the speculative engine
measures its own curve at load, and the budget controller and the gate read it.

Drafting time is timed on a synthetic context so that it is known before the first request; the
generator keeps refining it from the real drafts (goodput.DraftCost is an EMA).
"""

from __future__ import annotations

import datetime
import logging
import random
import statistics
import time
from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.goodput import CostCurve
from specgate.cost_model.quiet import MAX_OTHERS, Overlap
from specgate.decoding.config import CalibrationOverride
from specgate.decoding.sampling import SamplingParams
from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.machine import machine, wait_until_idle

log = logging.getLogger(__name__)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens per decode (root + draft nodes)


def measure(target: Target, slot: int, sizes: tuple[int, ...] = SIZES, context: int = 256, reps: int = 5, seed: int = 0) -> CostCurve:
    """The median compute time of one verification decode of each size, as the engine pays for it.

    Every decode runs at `context` cached tokens (each is rolled back after). A T-token decode is
    timed between plain one-token steps, the pattern of a request that drafts now and then, and is
    charged what it makes the plain step after it cost above a steady plain step: llama.cpp reuses
    its compute graph only while the batch shape stays the same (cost_model/live.py counts the
    same way when serving). Sizes are interleaved within each repetition so that machine noise
    spreads over all of them; `slot` is left released.

    Each repetition also times a run of plain one-token decodes in a row (the steady graph of a bare
    decode loop): the floor, recorded beside the curve.

    A repetition during which the rest of the machine computed (cost_model/quiet.py: the server's
    first request, the other engine) is repeated instead of counted, up to `reps` more times; past
    that the least disturbed ones count and the curve says how disturbed it was (`others`).
    """
    rng = random.Random(seed)
    vocab = target.info.vocab_size
    context = min(context, target.info.max_context - max(sizes) - 1)

    def decode(t: int) -> float:
        target.verify(slot, rng.randrange(vocab), DraftTree.chain([rng.randrange(vocab) for _ in range(t - 1)]), features=False)
        target.commit(slot, [0])
        target.truncate(slot, context)
        return target.last_verify_ms

    def repetition() -> tuple[float, dict[int, float], float]:
        """(others' share of the machine meanwhile, cost per size, the floor)."""
        with Overlap() as overlap:
            steady = [decode(1) for _ in range(4)]
            costs = {}
            for t in sizes:
                decode(1)  # back on the plain step's graph
                plain = decode(1)
                draft = decode(t)
                after = decode(1)
                costs[t] = plain if t == 1 else draft + after - plain
        return overlap.others, costs, statistics.median(steady[1:])

    try:
        target.prefill(slot, [rng.randrange(vocab) for _ in range(context)], features=False)
        repetition()  # warms caches and allocations, not counted
        runs = [repetition() for _ in range(reps)]
        for _ in range(reps):  # measure again what others disturbed, at most `reps` more times
            if sum(others <= MAX_OTHERS for others, _, _ in runs) >= reps:
                break
            runs.append(repetition())
    finally:
        target.release(slot)
    counted = sorted(runs, key=lambda run: run[0] > MAX_OTHERS)[:reps]  # the quiet ones first, in order
    return CostCurve(
        tokens=list(sizes), ms=[max(statistics.median(c[t] for _, c, _ in counted), 1e-3) for t in sizes], context=context,
        floor_ms=statistics.median(f for _, _, f in counted), others=max(o for o, _, _ in counted),
    )


class Proposer(Protocol):
    """What drafting-time measurement needs of a drafter (speculative.drafter.Drafter has it)."""

    name: ClassVar[str]
    uses_features: ClassVar[bool]

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None: ...
    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree: ...
    def accept(self, tree: DraftTree, path: list[int]) -> None: ...


@torch.inference_mode()  # as the engine drafts: with autograd on, the EAGLE head also recorded its graph
def time_drafter(target: Target, drafter: Proposer, k: int, context: int = 128, steps: int = 8, reps: int = 3, seed: int = 0) -> float:
    """Median drafting time of proposals of k nodes on a random context, per node or per step.

    The first proposal (which feeds the whole context to a drafter that reads features) is not
    counted. Then `reps` repetitions of `steps` proposals, each repeated (at most `reps` more
    times) if the rest of the machine computed meanwhile (cost_model/quiet.py), as measure() does."""
    rng = random.Random(seed)
    tokens = [rng.randrange(target.info.vocab_size) for _ in range(context)]
    tokens += tokens[-16:]  # a repeated tail, so that prompt lookup finds something to propose
    _, hidden = target.prefill(0, tokens[:-1], features=drafter.uses_features)
    drafter.begin(tokens[:-1], SamplingParams(), torch.Generator().manual_seed(seed))
    features = hidden if hidden is not None else torch.empty(0)
    per_node = ALGORITHMS[drafter.name].draft_cost_per_node

    def propose() -> float:
        nonlocal features
        start = time.perf_counter()
        tree = drafter.propose(tokens, features, k)
        elapsed = 1000 * (time.perf_counter() - start)
        drafter.accept(tree, [])
        # as after a step with nothing accepted: one more token, and (for EAGLE) one more feature
        tokens.append(rng.randrange(target.info.vocab_size))
        features = features[-1:]
        return elapsed / max(len(tree), 1) if per_node else elapsed

    def repetition() -> tuple[float, list[float]]:
        with Overlap() as overlap:
            times = [propose() for _ in range(steps)]
        return overlap.others, times

    try:
        propose()
        runs = [repetition() for _ in range(reps)]
        for _ in range(reps):
            if sum(others <= MAX_OTHERS for others, _ in runs) >= reps:
                break
            runs.append(repetition())
    finally:
        target.release(0)
    counted = sorted(runs, key=lambda run: run[0] > MAX_OTHERS)[:reps]
    return statistics.median(ms for _, times in counted for ms in times)


def measure_quiet(target: Target, sizes: tuple[int, ...] = SIZES) -> CostCurve:
    """The curve on slot 0, with a warning where the rest of the machine never let it measure quietly."""
    curve = measure(target, slot=0, sizes=sizes)
    if curve.others is not None and curve.others > MAX_OTHERS:
        log.warning("others took up to %.0f%% of the machine while the curve was measured: serving rescales it", 100 * curve.others)
    return curve


def calibrate(
    target: Target, drafters: Mapping[str, Proposer], override: CalibrationOverride | None = None, idle_timeout_s: float = 0.0
) -> Calibration:
    """Measure the curve and every drafter's cost on `target` (slot 0, idle), except what `override` pins.
    `idle_timeout_s` > 0: first wait (that long at most) until nothing else computes on the machine,
    unless `override` pins everything (then nothing is measured)."""
    start = time.perf_counter()
    override = override or CalibrationOverride()
    pinned = bool(override.cost_ratios) and override.base_ms is not None and set(drafters) <= set(override.draft_ms)
    if idle_timeout_s > 0 and not pinned:
        busy = wait_until_idle(timeout_s=idle_timeout_s)
        log.info("calibrating after %.0f s (machine %.0f%% busy)", time.perf_counter() - start, 100 * busy)
    if override.cost_ratios:
        base_ms = override.base_ms if override.base_ms is not None else measure_quiet(target, sizes=(1,)).ms[0]
        curve = CostCurve.of_ratios(override.cost_ratios, base_ms=base_ms)
    else:
        curve = measure_quiet(target)
    draft_ms = {
        name: override.draft_ms[name] if name in override.draft_ms else time_drafter(target, d, ALGORITHMS[name].default_k)
        for name, d in drafters.items()
    }
    info = target.info
    cal = Calibration.build(
        curve, draft_ms, set(override.draft_ms), machine=machine(), backend=info.backend, dtype=info.dtype, threads=info.threads,
        measured_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    )
    log.info("%s (took %.1f s)", cal.summary(), time.perf_counter() - start)
    return cal
