"""What spec_engine measured about its machine, as published for the gate (no torch: the gate reads it).

- `curve`: the verification cost curve (cost_model/measure.py measures it);
- per algorithm: its drafting time (ms per node for chain drafters, per step for trees), and from
  both the per-position acceptance at which drafting starts to pay (`break_even_alpha`).

spec_engine writes it as JSON (`EngineConfig.calibration_path`) at load and whenever it is asked to
measure again; the gate (cost_model/route.py) routes and sets its breaker thresholds from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.goodput import CostCurve, DraftCost, break_even_alpha, expected_speedup, rate_of_alpha
from specgate.machine import Machine


class AlgorithmCalibration(BaseModel):
    draft_ms: float  # per node (chain drafters) or per step (trees): see specgate.algorithms
    pinned: bool = False  # draft_ms came from an override, not a measurement
    break_even_alpha: float | None  # None: drafting does not pay even if every draft is accepted


class Calibration(BaseModel):
    machine: Machine
    backend: str
    dtype: str
    threads: int
    curve: CostCurve
    algorithms: dict[str, AlgorithmCalibration]
    measured_at: str
    refined_at: str | None = None  # when the engine last corrected it from its own decodes (refined)
    # measurements it is the median of: this start's and earlier starts' of the same engine on this
    # machine (cost_model/calibration_history.py)
    starts: int = 1

    @classmethod
    def build(cls, curve: CostCurve, draft_ms: dict[str, float], pinned: set[str], **info: object) -> "Calibration":
        algos = {}
        for name, ms in draft_ms.items():
            spec = ALGORITHMS[name]
            cost = DraftCost(per_node=spec.draft_cost_per_node, ms=ms)
            algos[name] = AlgorithmCalibration(
                draft_ms=ms, pinned=name in pinned, break_even_alpha=break_even_alpha(curve, cost, spec.default_k, spec.depth)
            )
        return cls(curve=curve, algorithms=algos, **info)  # type: ignore[arg-type]

    def refined(self, one_token_ms: float, draft_ms: dict[str, float], at: str) -> "Calibration":
        """This calibration at the one-token time and drafting times the engine has since observed
        (pinned drafting times stay as they were). The curve keeps its measured shape, cost(T)/cost(1),
        and floor: the machine's speed drifts, its shape far less, and served decodes measure the shape
        under whatever else runs (they once published cost(2)/cost(1) = 1.18 against 1.67-1.76 quiet)."""
        scale = one_token_ms / self.curve.ms[0]
        return self.rebuilt(self.curve.model_copy(update={"ms": [m * scale for m in self.curve.ms]}), draft_ms, refined_at=at)

    def rebuilt(self, curve: CostCurve, draft_ms: dict[str, float], **changes: object) -> "Calibration":
        """This calibration on another curve and drafting times (pinned drafting times and those
        `draft_ms` lacks stay as they were; break-even rates recomputed), with `changes` to its fields."""
        ms = {name: a.draft_ms if a.pinned else draft_ms.get(name, a.draft_ms) for name, a in self.algorithms.items()}
        pinned = {name for name, a in self.algorithms.items() if a.pinned}
        info = self.model_dump(include={"backend", "dtype", "threads", "measured_at", "starts", "refined_at"})
        return Calibration.build(curve, ms, pinned, **{**info, **changes}, machine=self.machine)

    def draft_cost(self, algorithm: str) -> DraftCost:
        a = self.algorithms[algorithm]
        return DraftCost(per_node=ALGORITHMS[algorithm].draft_cost_per_node, ms=a.draft_ms, pinned=a.pinned)

    def speedup(self, algorithm: str, alpha: float, k: int | None = None) -> float:
        """Expected speedup of drafting with `algorithm` (up to k nodes) at per-position acceptance alpha."""
        spec = ALGORITHMS[algorithm]
        return expected_speedup(self.curve, self.draft_cost(algorithm), alpha, k or spec.default_k, spec.depth)[0]

    def break_even_rate(self, algorithm: str) -> float | None:
        """The acceptance rate (accepted / drafted) below which `algorithm` stops paying."""
        alpha = self.algorithms[algorithm].break_even_alpha
        return None if alpha is None else rate_of_alpha(alpha, ALGORITHMS[algorithm].default_depth)

    def summary(self) -> str:
        lines = [
            f"calibration on {self.machine.line()}; {self.backend} {self.dtype}, {self.threads} threads",
            f"  verify cost (tokens:ms): {self.curve.table()}" + ("" if self.curve.measured else " (injected)")
            + ("" if self.starts == 1 else f" (shape: median of {self.starts} starts' measurements)")
            + ("" if self.refined_at is None else f" (rescaled to served one-token decodes, {self.refined_at})")
            + ("" if self.curve.floor_ms is None else f"; floor (bare one-token decode loop) {self.curve.floor_ms:.2f} ms")
            + ("" if self.curve.others is None else f"; others used {100 * self.curve.others:.0f}% of the machine meanwhile"),
        ]
        for name, a in self.algorithms.items():
            spec = ALGORITHMS[name]
            pays = "never pays" if a.break_even_alpha is None else f"pays above per-position acceptance {a.break_even_alpha:.2f}"
            lines.append(
                f"  {name}: drafting {a.draft_ms:.2f} ms/{'node' if spec.draft_cost_per_node else 'step'}; k={spec.default_k} {pays} "
                f"(prior {spec.prior_acceptance:.2f}: {self.speedup(name, spec.prior_acceptance):.2f}x)"
            )
        return "\n".join(lines)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)  # readers never see a half-written file

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        return cls.model_validate(json.loads(path.read_text()))

    @staticmethod
    def withdraw(path: Path) -> None:
        """Take a published calibration back: its engine is about to measure again and serves nothing
        meanwhile (the gate routes to the baseline while no file is there: reason `calibrating`)."""
        path.unlink(missing_ok=True)
