"""Shared benchmark plumbing: a server started for the run, summary statistics, result files."""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
GGUF = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the shipped model (build/fetch_model.py)


def spread(xs: list[float], fmt: str = ".1f") -> str:
    """median [min-max], the way every table in the project reports a measurement."""
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def tpot_ms(times: list[float], n: int) -> float:
    """Time per token after the first: (last emission - first emission) / (tokens - 1)."""
    return 1000 * (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else float("nan")


class _Timed(Protocol):
    tpot_ms: float


TimedRun = TypeVar("TimedRun", bound=_Timed)


def median_run(runs: list[TimedRun]) -> TimedRun:
    """The run of median TPOT, the lower middle one of an even count; runs without a TPOT (NaN) last."""
    ranked = sorted(runs, key=lambda r: (math.isnan(r.tpot_ms), r.tpot_ms))
    return ranked[(len(ranked) - 1) // 2]


BATCHING_BAR = 0.9  # issue 50 (issue 24 had asked 0.8)


def batching_check(scaling: float, curve) -> str:  # noqa: ANN001 (a CostCurve, or None if calibration failed)
    """The bar for the batched baseline: throughput at c=8 over c=1's >= BATCHING_BAR x what the
    calibrated curve allows, 8 cost(1) / cost(8) (8 sequences cost one decode of 8 tokens)."""
    if curve is None:
        return f"c=8 / c=1 throughput {scaling:.2f}x (no calibration: no target)."
    allowed = 8 * curve.cost(1) / curve.cost(8)
    target = BATCHING_BAR * allowed
    return (f"c=8 / c=1 throughput {scaling:.2f}x; the curve allows 8 x cost(1) / cost(8) = {allowed:.2f}x, "
            f"target >= {BATCHING_BAR} x that = {target:.2f}x: {'met' if scaling >= target else 'NOT met'}.")


def batching_bound_with_prompts(ttft_ms: float, tpot_ms: float, tokens: float, curve) -> float:  # noqa: ANN001 (a CostCurve)
    """What the curve allows c=8 over c=1 once the prompts are counted: a c=1 request spends
    `ttft_ms` reading its prompt, then `tokens` - 1 decodes of `tpot_ms`; eight of them at once read
    eight prompts (prefill is already a many-row product: batching does not make it cheaper) and
    share each decode, at cost(8) / cost(1) of one. 8 cost(1) / cost(8) leaves the prompts out, which
    with replies of 48 tokens after prompts of a few hundred is a third of the c=8 work."""
    decode = (tokens - 1) * tpot_ms
    return 8 * (ttft_ms + decode) / (8 * ttft_ms + decode * curve.cost(8) / curve.cost(1))


def write_results(name: str, markdown: str, raw: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(markdown)
    (RESULTS / f"{name}.json").write_text(json.dumps(raw, indent=2))
    print(f"\nwrote results/{name}.md and results/{name}.json")


@contextmanager
def running_server(repo: Path, http: int = 38000, grpc: int = 38001, metrics: int = 38002) -> Iterator:
    """A tritonserver for the benchmark on its own ports, stopped afterwards: yields its ports and its pid."""
    from specgate_launcher import Ports, running

    ports = Ports(http, grpc, metrics)
    # one log per run (start() truncates its log): runs on other ports, or later runs, keep theirs
    log = RESULTS / f"bench-server-{http}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    RESULTS.mkdir(exist_ok=True)
    with running(repo, ports, log) as proc:
        wait_calibrated(repo)
        yield ports, proc.pid


def wait_calibrated(repo: Path) -> Path | None:
    """specgate_launcher.wait_calibrated, with progress: a cell measured while spec_engine calibrates
    shares the cores with it, and the gate sends everything to the baseline meanwhile."""
    from specgate_launcher import wait_calibrated as wait

    start = time.monotonic()
    print("[bench] waiting for spec_engine's start-up calibration ...", flush=True)
    published = wait(repo)
    print(f"[bench] calibrated after {time.monotonic() - start:.0f} s", flush=True)
    return published


def wait_quiet(timeout_s: float = 300.0) -> None:
    """Wait until the machine is idle before measuring (a server's start-up work, or anything else)."""
    from specgate.machine import wait_until_idle

    busy = wait_until_idle(max_busy=0.05, window_s=2.0, timeout_s=timeout_s)
    if busy > 0.05:
        print(f"[bench] warning: the machine is still {busy:.0%} busy after {timeout_s:.0f} s; measuring anyway", flush=True)


def machine_record() -> dict:
    """What decides the speed of this run: CPU model and ISA flags, and the instruction sets the two
    runtimes were built or capped to (llama.cpp's build; PyTorch's ATen and oneDNN caps)."""
    import os

    import torch

    from specgate.machine import machine

    m = machine()
    record = {"cpu": m.cpu_model, "cores": m.cores, "isa": m.isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    record["onednn_max_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA", "(not capped)")
    try:
        import llama_cpp

        record["llama_cpp"] = llama_cpp.llama_print_system_info().decode().strip()
    except ImportError:
        record["llama_cpp"] = "not installed"
    return record


def machine_lines(record: dict) -> list[str]:
    flags = " ".join(f for f, on in record["isa"].items() if on)
    return [
        f"- machine: {record['cpu']}, {record['cores']} cores; CPU flags: {flags}",
        f"- llama.cpp build: {record['llama_cpp']}",
        f"- PyTorch kernels: {record['torch_cpu_capability']}; oneDNN ISA cap: {record['onednn_max_isa']}",
    ]
