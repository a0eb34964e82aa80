"""Measuring spec_engine's machine at load: the cost curve and each drafter's drafting time.

Drafting time is timed on a synthetic context so that it is known before the first request; the
generator keeps refining it from the real drafts (DraftCost is an EMA).
"""

from __future__ import annotations

import datetime
import logging
import random
import time

import torch

from specgate.algorithms import ALGORITHMS
from specgate.calibration import Calibration, CalibrationOverride
from specgate.decoding.cost_curve import measure
from specgate.decoding.machine import machine, wait_until_idle
from specgate.decoding.sampling import SamplingParams
from specgate.decoding.target import Target
from specgate.goodput import CostCurve
from specgate.speculative.drafter import Drafter

log = logging.getLogger(__name__)

FLOOR_TOLERANCE = 0.15  # cost(1) may differ this much from the bare decode loop measured beside it
ATTEMPTS = 3  # measurements of the curve, at most, until one agrees with its floor


def time_drafter(target: Target, drafter: Drafter, k: int, context: int = 128, steps: int = 4, seed: int = 0) -> float:
    """Median drafting time of `steps` proposals of k nodes on a random context: per node or per step."""
    rng = random.Random(seed)
    tokens = [rng.randrange(target.info.vocab_size) for _ in range(context)]
    tokens += tokens[-16:]  # a repeated tail, so that prompt lookup finds something to propose
    _, hidden = target.prefill(0, tokens[:-1], features=drafter.uses_features)
    drafter.begin(tokens[:-1], SamplingParams(), torch.Generator().manual_seed(seed))
    features = hidden if hidden is not None else torch.empty(0)
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            tree = drafter.propose(tokens, features, k)
            elapsed = 1000 * (time.perf_counter() - start)
            drafter.accept(tree, [])
            # as after a step with nothing accepted: one more token, and (for EAGLE) one more feature
            tokens.append(rng.randrange(target.info.vocab_size))
            features = features[-1:]
            times.append(elapsed / max(len(tree), 1) if ALGORITHMS[drafter.name].draft_cost_per_node else elapsed)
    finally:
        target.release(0)
    return sorted(times)[len(times) // 2]


def measure_checked(target: Target, sizes: tuple[int, ...] | None = None) -> CostCurve:
    """The curve, measured again (up to ATTEMPTS times) until its cost(1) agrees with the bare decode
    loop measured beside it; the closest attempt otherwise, with a warning. Disagreement means the
    machine was busy with something else during part of the measurement."""
    best: CostCurve | None = None
    for attempt in range(ATTEMPTS):
        curve = measure(target, slot=0) if sizes is None else measure(target, slot=0, sizes=sizes)
        error = abs(curve.ms[0] / curve.floor_ms - 1)
        if best is None or error < abs(best.ms[0] / best.floor_ms - 1):
            best = curve
        if error <= FLOOR_TOLERANCE:
            return curve
        log.info("cost(1) %.2f ms is %.0f%% from the bare decode loop's %.2f ms (attempt %d): measuring again",
                 curve.ms[0], 100 * error, curve.floor_ms, attempt + 1)
    assert best is not None
    log.warning("cost(1) %.2f ms stays %.0f%% from the bare decode loop's %.2f ms: the machine was busy; serving will correct the curve",
                best.ms[0], 100 * abs(best.ms[0] / best.floor_ms - 1), best.floor_ms)
    return best


def calibrate(
    target: Target, drafters: dict[str, Drafter], override: CalibrationOverride | None = None, idle_timeout_s: float = 0.0
) -> Calibration:
    """Measure the curve and every drafter's cost on `target` (slot 0, idle), except what `override` pins.
    `idle_timeout_s` > 0: first wait (that long at most) until nothing else computes on the machine."""
    start = time.perf_counter()
    override = override or CalibrationOverride()
    if idle_timeout_s > 0:
        busy = wait_until_idle(timeout_s=idle_timeout_s)
        log.info("calibrating after %.0f s (machine %.0f%% busy)", time.perf_counter() - start, 100 * busy)
    if override.cost_ratios:
        curve = CostCurve.of_ratios(override.cost_ratios, base_ms=measure_checked(target, sizes=(1,)).ms[0])
    else:
        curve = measure_checked(target)
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
