"""What spec_engine measures about its machine at load, and publishes for the gate.

- the verification cost curve (engine/cost_curve.py);
- each drafter's drafting time (ms per node for chain drafters, per step for trees), timed on a
  synthetic context so that it is known before the first request;
- from both, per algorithm: the acceptance rate at which speculation starts to pay (break-even)
  and the speedup expected at the algorithm's prior acceptance.

The engine writes this as JSON (`EngineConfig.calibration_path`); the gate reads it to route only
where speculation is expected to pay and to set its breaker thresholds (gate/calibration.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import time
from pathlib import Path

import torch
from pydantic import BaseModel

from specgate.algorithms import ALGORITHMS
from specgate.engine.cost_curve import CostCurve, measure
from specgate.engine.machine import Machine, machine
from specgate.engine.sampling import SamplingParams
from specgate.engine.target import Target, TargetInfo
from specgate.speculative.budget import Acceptance, DraftCost, break_even_rate
from specgate.speculative.drafter import Drafter

log = logging.getLogger(__name__)


class AlgorithmCalibration(BaseModel):
    draft_ms: float  # per node (chain drafters) or per step (trees): see specgate.algorithms
    max_budget: int  # the algorithm's default k: the cap the numbers below assume
    break_even_rate: float | None  # None: no budget pays even if every draft is accepted
    prior_rate: float  # accepted / drafted expected before any observation (from the prior)


class Calibration(BaseModel):
    machine: Machine
    backend: str
    dtype: str
    threads: int
    curve: CostCurve
    algorithms: dict[str, AlgorithmCalibration]
    measured_at: str

    def draft_cost(self, algorithm: str) -> DraftCost:
        return DraftCost(per_node=ALGORITHMS[algorithm].draft_cost_per_node, ms=self.algorithms[algorithm].draft_ms)

    def summary(self) -> str:
        lines = [
            f"calibration on {self.machine.line()}; {self.backend} {self.dtype}, {self.threads} threads",
            f"  verify cost (tokens:ms): {self.curve.table()}" + ("" if self.curve.measured else " (injected)"),
        ]
        for name, a in self.algorithms.items():
            be = "never pays" if a.break_even_rate is None else f"pays above acceptance {a.break_even_rate:.2f}"
            lines.append(f"  {name}: drafting {a.draft_ms:.2f} ms/{'node' if ALGORITHMS[name].draft_cost_per_node else 'step'}, k={a.max_budget}: {be} (prior {a.prior_rate:.2f})")
        return "\n".join(lines)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)  # readers never see a half-written file

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        return cls.model_validate(json.loads(path.read_text()))


def prior_rate(algorithm: str) -> float:
    """accepted / drafted at the default k under the algorithm's prior per-position acceptance."""
    spec = ALGORITHMS[algorithm]
    depth = spec.default_k if spec.max_depth is None else min(spec.default_k, spec.max_depth)
    return Acceptance(prior=[spec.prior_acceptance]).expected(depth)[-1] / spec.default_k


def time_drafter(target: Target, drafter: Drafter, k: int, context: int = 128, steps: int = 4, seed: int = 0) -> float:
    """Median drafting time of `steps` proposals of k nodes on a random context: per node or per step."""
    rng = random.Random(seed)
    tokens = [rng.randrange(target.info.vocab_size) for _ in range(context)]
    tokens += tokens[-16:]  # a repeated tail, so that prompt lookup finds something to propose
    _, hidden = target.prefill(0, tokens[:-1], features=drafter.uses_features)
    gen = torch.Generator().manual_seed(seed)
    drafter.begin(tokens[:-1], SamplingParams(), gen)
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
            nodes = max(len(tree), 1)
            times.append(elapsed / nodes if ALGORITHMS[drafter.name].draft_cost_per_node else elapsed)
    finally:
        target.release(0)
    return sorted(times)[len(times) // 2]


def calibrate(target: Target, drafters: dict[str, Drafter], curve: CostCurve | None = None) -> Calibration:
    """Measure the curve (unless one is injected) and every drafter's cost on `target` (slot 0, idle)."""
    start = time.perf_counter()
    curve = curve or measure(target, slot=0)
    algos = {}
    for name, drafter in drafters.items():
        spec = ALGORITHMS[name]
        draft_ms = time_drafter(target, drafter, spec.default_k)
        cost = DraftCost(per_node=spec.draft_cost_per_node, ms=draft_ms)
        algos[name] = AlgorithmCalibration(
            draft_ms=draft_ms, max_budget=spec.default_k, break_even_rate=break_even_rate(curve, cost, spec.default_k), prior_rate=prior_rate(name)
        )
    info: TargetInfo = target.info
    cal = Calibration(
        machine=machine(), backend=info.backend, dtype=info.dtype, threads=info.threads, curve=curve, algorithms=algos,
        measured_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    )
    log.info("%s (took %.1f s)", cal.summary(), time.perf_counter() - start)
    return cal
