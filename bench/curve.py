"""`make bench-curve`: the verification cost curve of the llama.cpp target, its kernel sets side by side.

In one process, rounds alternated so that the machine's drift hits all alike:
- exact: the served default (batch-invariant; the patch's tile kernels and blocked attention; repacked
  weights where the engine's probe kept them, AMX on a CPU that has it);
- exact, per-row kernels: the earlier exact mode (weights in the file's layout, ggml's per-row dot
  products and one-chunk attention: `ggml_cpu_set_tile_kernels(false)`);
- upstream: batch invariance off (what plain llama.cpp runs; not exact across batch sizes).

Each target is loaded as spec_engine loads it (artifacts/engines/cpu/spec_engine.json: context,
threads; room for the largest draft tree), so that the served calibration can be held against it.
Per kernel set: cost(1) in ms and cost(T)/cost(1) at T = 2, 4, 8, 16 (cost_model/measure.measure:
256 cached tokens, a draft step charged the re-plan it causes, repetitions others disturbed measured
again), the floor (a bare one-token decode loop), and the prefill of a 600-token prompt; medians
[min-max] over the rounds. Issue 48's bars are printed beside them.

    python -m bench.curve --rounds 3 [--gguf path.gguf]
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import GGUF, ROOT, machine_lines, machine_record, spread, wait_quiet, write_results
from specgate.algorithms import MAX_TREE_NODES
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.measure import measure
from specgate.decoding.config import EngineConfig
from specgate.decoding.llamacpp_native import native
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.machine import machine

SIZES = (1, 2, 4, 8, 16)
SPEC_ENGINE = ROOT / "artifacts" / "engines" / "cpu" / "spec_engine.json"  # make build-engines writes it
PREFILL = 600


@dataclass
class KernelSet:
    name: str
    target: LlamaCppTarget
    tiles: bool
    cost1: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    ratios: dict[int, list[float]] = field(default_factory=lambda: {t: [] for t in SIZES})
    prefill: list[float] = field(default_factory=list)

    def measure_round(self, rng: random.Random) -> None:
        native().set_tile_kernels(self.tiles)
        try:
            curve = measure(self.target, slot=0, sizes=SIZES, reps=3)
            self.cost1.append(curve.ms[0])
            self.floor.append(curve.floor_ms or float("nan"))
            for t in SIZES:
                self.ratios[t].append(curve.ratio(t))
            prompt = [rng.randrange(self.target.info.vocab_size) for _ in range(PREFILL)]
            start = time.perf_counter()
            self.target.prefill(0, prompt, features=False)
            self.prefill.append(1000 * (time.perf_counter() - start))
            self.target.release(0)
        finally:
            native().set_tile_kernels(True)


def load(gguf: Path) -> list[KernelSet]:
    """Each kernel set's target as spec_engine loads it (its context and threads, room for the largest
    draft tree), so that what it measures is what the served calibration measured."""
    served = EngineConfig.load(SPEC_ENGINE)

    def target(exact: bool, repack: bool = True) -> LlamaCppTarget:
        return LlamaCppTarget(gguf, served.max_context, num_slots=1, threads=served.threads, tree_nodes=MAX_TREE_NODES, exact=exact,
                              repack=repack)

    return [
        KernelSet("exact", target(True), tiles=True),
        KernelSet("exact, per-row kernels (before)", target(True, repack=False), tiles=False),  # the file's layout, as it was
        KernelSet("upstream (not exact)", target(False), tiles=True),
    ]


def report(sets: list[KernelSet], gguf: Path, record: dict, rounds: int, command: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Verification cost curve, {gguf.name} ({now})",
        "",
        f"`{command}`: {rounds} rounds, the kernel sets alternated within each; median [min-max] over rounds.",
        *machine_lines(record),
        "- exact target's weights: "
        f"{'repacked (AMX / CPU repack, kept by its invariance probe)' if sets[0].target.repacked else 'file layout'}",
        "",
        "| kernels | cost(1) ms | floor ms | " + " | ".join(f"T={t}" for t in SIZES[1:]) + f" | prefill {PREFILL} ms |",
        "|---|---|---|" + "---|" * (len(SIZES) - 1) + "---|",
    ]
    for s in sets:
        lines.append(
            f"| {s.name} | {spread(s.cost1, '.2f')} | {spread(s.floor, '.2f')} | "
            + " | ".join(spread(s.ratios[t], ".2f") for t in SIZES[1:])
            + f" | {spread(s.prefill, '.0f')} |"
        )
    new, old = sets[0], sets[1]
    c4, c8 = statistics.median(new.ratios[4]), statistics.median(new.ratios[8])
    one = statistics.median(a / b for a, b in zip(new.cost1, old.cost1))
    pre = statistics.median(a / b for a, b in zip(new.prefill, old.prefill))
    lines += [
        "",
        "Issue 48's bars for exact mode (paired per round against the per-row kernels):",
        f"- cost(4)/cost(1) {c4:.2f} (<= 1.7: {'met' if c4 <= 1.7 else 'NOT met'}); "
        f"cost(8)/cost(1) {c8:.2f} (<= 2.5: {'met' if c8 <= 2.5 else 'NOT met'})",
        f"- cost(1) {one:.2f}x the per-row kernels' (<= 1.03: {'met' if one <= 1.03 else 'NOT met'})",
        f"- prefill of {PREFILL} tokens {pre:.2f}x the per-row kernels' (<= 1.0: {'met' if pre <= 1.0 else 'NOT met'})",
    ]
    if gguf == GGUF:
        lines += served_calibration(new)
    return "\n".join(lines) + "\n"


CALIBRATION_BAR = 0.15  # issue 47: the published cost(T)/cost(1) within 15% of a quiet measurement


def served_calibration(exact: KernelSet) -> list[str]:
    """The calibration the server last published for the gate (make serve, or a benchmark's server on
    the default repository), held against this run's quiet exact curve."""
    path = EngineConfig.load(SPEC_ENGINE).calibration_path  # where spec_engine publishes it (CALIBRATION_PATH=)
    if path is None or not path.exists():
        return ["", f"No served calibration to compare ({path or 'no calibration_path'}: a running spec_engine writes it)."]
    cal = Calibration.load(path)
    if cal.machine != machine():
        return ["", f"The served calibration ({cal.measured_at}) was measured on another machine: {cal.machine.line()}."]
    apart = {t: cal.curve.ratio(t) / statistics.median(exact.ratios[t]) - 1 for t in SIZES[1:]}
    worst = max(abs(a) for a in apart.values())
    return [
        "",
        f"The served calibration ({path}, measured {cal.measured_at}, median of {cal.starts} start(s)) "
        "against this run's exact curve:",
        "- " + "; ".join(f"T={t}: {cal.curve.ratio(t):.2f} ({100 * a:+.0f}%)" for t, a in apart.items()),
        f"- issue 47: within {100 * CALIBRATION_BAR:.0f}% at every T: {'met' if worst <= CALIBRATION_BAR else 'NOT met'} "
        f"(at most {100 * worst:.0f}% apart)",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="bench-curve")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # llama.cpp's pool owns the cores (decoding/loading.py)
    record = machine_record()
    print("\n".join(machine_lines(record)), flush=True)
    sets = load(args.gguf)
    wait_quiet()
    rng = random.Random(0)
    for r in range(args.rounds):
        for s in sets if r % 2 == 0 else reversed(sets):
            s.measure_round(rng)
            print(f"[bench] round {r} {s.name}: cost(1) {s.cost1[-1]:.2f} ms, "
                  + " ".join(f"T={t}:{s.ratios[t][-1]:.2f}" for t in SIZES[1:]) + f", prefill {s.prefill[-1]:.0f} ms", flush=True)
    command = f"python -m bench.curve --rounds {args.rounds}" + ("" if args.gguf == GGUF else f" --gguf {args.gguf}")
    md = report(sets, args.gguf, record, args.rounds, command)
    print(md)
    raw = {"machine": record, "gguf": str(args.gguf), "rounds": args.rounds, "repacked": sets[0].target.repacked,
           "sets": {s.name: {"cost1_ms": s.cost1, "floor_ms": s.floor, "ratios": {str(t): v for t, v in s.ratios.items()},
                             "prefill_ms": s.prefill} for s in sets}}
    write_results(args.name, md, raw)


if __name__ == "__main__":
    main()
