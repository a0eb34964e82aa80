"""`make bench-batching`: in-flight batching vs no batching vs speculation, at concurrency 1, 2, 4, 8.

Configurations, all driven in-process (no Triton), same model, engine and prompts, greedy:
- batched:     BatchRunner, max_batch_size=8 (the baseline engine as served)
- unbatched:   BatchRunner, max_batch_size=1 (requests queue, one at a time)
- spec-<alg>:  SpeculativeRunner (one sequence at a time, FIFO) for each measured algorithm

A cell (configuration x concurrency c) submits the first c of 8 chat prompts of the project's
benchmark set (bench/prompts.py, chat template) at once, up to --tokens new tokens each (EOS ends a
request early), and waits for all of them. Throughput = all output tokens / the cell's wall time.
TPOT per request = time from its first to its last token / tokens after the first (queueing shows
up in TTFT, not TPOT). Every repeat runs every cell once, in a rotated order, so
machine noise spreads over all configurations; the table gives median [min-max] over repeats.

Floor: our engine's bare decode loop (bench/peer.py, `floor`) on the first prompt, in a fresh
process of its own, once per repeat while every runner here is idle: what c=1 should approach.
c=8 target: batched throughput at c=8 over c=1 against what the calibrated curve allows,
8 x cost(1) / cost(8) (a decode of 8 tokens costs about what 8 sequences' next tokens cost).
Beside it, the batched runner's own steps (`StepLog`): a decode step of 8 sequences against one of
a single sequence (what batching 8 can buy at most), and the share of the c=8 cells' step time
spent in steps that take in prompt tokens, which batching does not make cheaper.

Crossover: the lowest c at which batched throughput (median) exceeds the speculative engine's. The
gate's `load.max_in_flight` counts requests already in flight, so it should be crossover - 1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from bench.common import ROOT, batching_check, machine_lines, machine_record, median, spread, write_results
from bench.peer import DecodeProcess
from bench.prompts import load_prompts
from specgate.algorithms import MAX_TREE_NODES
from specgate.decoding.batch_runner import BatchRunner
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.request import Event, GenerationRequest
from specgate.speculative.registry import build_drafters
from specgate.speculative.spec_runner import SpeculativeRunner
from specgate.text.tokenizer import PromptTokenizer

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
DRAFT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-draft"
HEAD = ROOT / "heads" / "smollm2-135m-eagle"
CONCURRENCY = (1, 2, 4, 8)
MAX_CONTEXT = 512

Submit = Callable[[GenerationRequest, Callable[[Event], None]], None]


@dataclass
class Trace:
    """One request's timeline."""

    submitted: float
    event_times: list[float] = field(default_factory=list)
    event_sizes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def emit(self, ev: Event) -> None:
        if ev.tokens:
            self.event_times.append(time.perf_counter())
            self.event_sizes.append(len(ev.tokens))
            self.tokens += ev.tokens
        if ev.finished:
            self.error = ev.error
            self.done.set()

    @property
    def ttft_s(self) -> float:
        return self.event_times[0] - self.submitted

    @property
    def tpot_ms(self) -> float | None:
        after_first = len(self.tokens) - self.event_sizes[0]
        return (self.event_times[-1] - self.event_times[0]) * 1e3 / after_first if after_first else None


class StepLog:
    """Every forward of one runner's target as (sequences, tokens, ms). Wraps the instance's
    `forward`: the runner has no hook for it, and a benchmark must not add one to the served path."""

    def __init__(self, target) -> None:  # noqa: ANN001 (a Target)
        self.steps: list[tuple[int, int, float]] = []
        self._forward = target.forward
        target.forward = self._timed

    def _timed(self, items):  # noqa: ANN001, ANN202 (Target.forward's signature)
        start = time.perf_counter()
        out = self._forward(items)
        self.steps.append((len(items), sum(len(t) for _, t in items), 1000 * (time.perf_counter() - start)))
        return out

    def take(self) -> list[tuple[int, int, float]]:
        steps, self.steps = self.steps, []
        return steps


def step_summary(c1: list[dict], c8: list[dict]) -> dict | None:
    """From the batched cells' steps: median ms of a decode step of 1 and of 8 sequences, and the
    share of the c=8 cells' step time in steps that took in prompt tokens (None without both sizes)."""
    one = [ms for cell in c1 for n, t, ms in cell["steps"] if n == t == 1]
    eight = [ms for cell in c8 for n, t, ms in cell["steps"] if n == t == 8]
    if not one or not eight:
        return None
    steps8 = [s for cell in c8 for s in cell["steps"]]
    prompt_ms = sum(ms for n, t, ms in steps8 if t > n)
    return {
        "step1_ms": statistics.median(one),
        "step8_ms": statistics.median(eight),
        "prompt_share_c8": prompt_ms / sum(ms for _, _, ms in steps8),
    }


def run_cell(submit: Submit, prompts: list[list[int]], max_new: int, end_id: int) -> dict:
    """Submit all prompts at once, wait for all; raw per-request numbers and the cell's throughput."""
    traces = []
    start = time.perf_counter()
    for ids in prompts:
        tr = Trace(time.perf_counter())
        submit(GenerationRequest(input_ids=ids, max_new_tokens=max_new, end_id=end_id), tr.emit)
        traces.append(tr)
    for tr in traces:
        if not tr.done.wait(1800):
            raise TimeoutError("a benchmark request never finished")
        if tr.error:
            raise RuntimeError(f"benchmark request failed: {tr.error}")
    wall = max(tr.event_times[-1] for tr in traces) - start
    tokens = sum(len(tr.tokens) for tr in traces)
    tpots = [t for tr in traces if (t := tr.tpot_ms) is not None]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "tpot_ms": tpots,
        "ttft_s": [tr.ttft_s for tr in traces],
        "outputs": [tr.tokens for tr in traces],
    }


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (few samples per cell: no interpolation)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summarize(cells: list[dict]) -> dict:
    """Per-repeat statistics of one configuration x concurrency, then their median and range."""
    per_rep = {
        "tok_s": [c["tok_s"] for c in cells],
        "tpot_p50_ms": [statistics.median(c["tpot_ms"]) for c in cells],
        "tpot_p95_ms": [percentile(c["tpot_ms"], 95) for c in cells],
        "ttft_p50_s": [statistics.median(c["ttft_s"]) for c in cells],
    }
    return {k: {"median": median(v), "min": min(v), "max": max(v), "values": v} for k, v in per_rep.items()}


def crossover(summary: dict, spec: str) -> int | None:
    for c in CONCURRENCY:
        if summary["batched"][c]["tok_s"]["median"] > summary[spec][c]["tok_s"]["median"]:
            return c
    return None


@dataclass
class Setup:
    """The configurations of one run: name -> how to submit a request, and what to shut down."""

    configs: dict[str, Submit]
    steps: StepLog  # the batched runner's
    runners: list
    drafters: list[str]
    spec: SpeculativeRunner
    floor: DecodeProcess | None  # llama.cpp only: the bare loop in a fresh process


def build(args: argparse.Namespace) -> Setup:
    """The baseline engine batched and unbatched, and the speculative engine as build_engines
    configures it (every drafter whose weights exist, calibrated on this machine)."""
    gguf = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = gguf if args.backend == "llamacpp" else CKPT
    # Waiting is part of what is measured (TTFT): no request may time out in a queue.
    base = EngineConfig(backend=args.backend, model=model, max_context=MAX_CONTEXT, num_threads=args.threads, queue_timeout_s=1e6)
    draft = gguf.with_name(f"{gguf.stem}.draft-4L.gguf") if args.backend == "llamacpp" else DRAFT
    spec_cfg = base.model_copy(update={
        "max_batch_size": 1, "draft_model": draft if draft.exists() else None,
        "eagle_head_dir": HEAD if (HEAD / "eagle_head.safetensors").exists() else None,
    })
    # every target in the mode the server runs (cfg.exact), as engine_model loads them
    target = load_target(spec_cfg, model, num_slots=1, tree_nodes=MAX_TREE_NODES, exact=base.exact)
    spec = SpeculativeRunner(target, build_drafters(target, spec_cfg), spec_cfg)
    batched_target = load_target(base, model, num_slots=8, exact=base.exact)
    steps = StepLog(batched_target)
    batched = BatchRunner(batched_target, base.model_copy(update={"max_batch_size": 8}))
    unbatched = BatchRunner(load_target(base, model, num_slots=1, exact=base.exact), base.model_copy(update={"max_batch_size": 1}))
    configs: dict[str, Submit] = {"batched": batched.submit, "unbatched": unbatched.submit}
    for alg in args.algorithms.split(","):
        configs[f"spec-{alg}"] = lambda r, emit, alg=alg: spec.submit(r, emit, algorithm=alg)
    floor = DecodeProcess("floor", gguf, MAX_CONTEXT, base.threads, exact=base.exact) if args.backend == "llamacpp" else None
    return Setup(configs, steps, [batched, unbatched, spec], sorted(spec.generator.drafters), spec, floor)


def measure(
    setup: Setup, prompts: list[list[int]], args: argparse.Namespace, eos: int
) -> tuple[dict[str, dict[int, list[dict]]], list[float]]:
    """Every cell once per repeat, in an order rotated per repeat; the floor once per repeat."""
    for submit in setup.configs.values():  # warm-up: first-call allocations and kernel selection
        run_cell(submit, prompts[:2], 8, eos)
    cells: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in CONCURRENCY} for name in setup.configs}
    floor_ms: list[float] = []
    names = list(setup.configs)
    for rep in range(args.repeats):
        if setup.floor is not None:
            floor_ms.append(setup.floor.run(prompts[0], args.tokens, eos=eos).tpot_ms)
            print(f"  rep {rep + 1} floor {floor_ms[-1]:.2f} ms/token", flush=True)
        order = names[rep % len(names):] + names[: rep % len(names)]
        for c in CONCURRENCY:
            for name in order:
                setup.steps.take()
                cell = run_cell(setup.configs[name], prompts[:c], args.tokens, eos)
                if name == "batched":
                    cell["steps"] = setup.steps.take()
                cells[name][c].append(cell)
                print(f"  rep {rep + 1} c={c} {name:14s} {cell['tok_s']:6.1f} tok/s  {cell['tokens']} tokens in {cell['wall_s']:.1f}s",
                      flush=True)
    return cells, floor_ms


def report(
    args: argparse.Namespace, started: datetime, machine: dict, setup: Setup, cells: dict, floor_ms: list[float]
) -> tuple[str, dict]:
    configs = setup.configs
    summary = {name: {c: summarize(cells[name][c]) for c in CONCURRENCY} for name in configs}
    # llama.cpp's numbers can differ with the batch shape, so report how often outputs equal the unbatched ones.
    match = {
        name: {
            c: statistics.mean(
                out == ref
                for cell, ref_cell in zip(cells[name][c], cells["unbatched"][c])
                for out, ref in zip(cell["outputs"], ref_cell["outputs"])
            )
            for c in CONCURRENCY
        }
        for name in configs
    }
    cross = {n: crossover(summary, n) for n in configs if n.startswith("spec-")}
    b = summary["batched"]
    scaling = b[8]["tok_s"]["median"] / b[1]["tok_s"]["median"]
    tpot_ratio = b[8]["tpot_p50_ms"]["median"] / b[1]["tpot_p50_ms"]["median"]
    curve = setup.spec.calibration.curve if setup.spec.calibration else None
    steps = step_summary(cells["batched"][1], cells["batched"][8])
    lines = [
        f"# bench-batching ({args.backend}, greedy, up to {args.tokens} new tokens, {args.repeats} repeats, median [min-max])",
        "",
        f"- command: `python -m bench.batching --backend {args.backend} --tokens {args.tokens} --repeats {args.repeats} "
        f"--algorithms {args.algorithms}` ({started:%Y-%m-%d %H:%M} UTC)",
        *machine_lines(machine),
        f"- drafters loaded: {', '.join(setup.drafters)}; the speculative engine calibrated on this machine"
        + (f": cost(1) {curve.cost(1):.2f} ms, cost(8) {curve.ratio(8):.2f}x" if curve else " (calibration failed)"),
        (
            f"- floor (bare decode loop, fresh process, first prompt, once per repeat): {spread(floor_ms)} ms/token"
            if floor_ms
            else "- floor: llama.cpp only"
        ),
        "",
        "| c | configuration | throughput tok/s | TPOT p50 ms | TPOT p95 ms | TTFT p50 s | outputs = unbatched |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in CONCURRENCY:
        for name in configs:
            s = summary[name][c]
            lines.append(
                f"| {c} | {name} | {spread(s['tok_s']['values'])} | {spread(s['tpot_p50_ms']['values'])} | "
                f"{spread(s['tpot_p95_ms']['values'])} | {spread(s['ttft_p50_s']['values'])} | {match[name][c]:.0%} |"
            )
    lines += [
        "",
        f"- Batched {batching_check(scaling, curve)}",
        (
            f"- Batched steps: a decode step of 8 sequences {steps['step8_ms']:.1f} ms against {steps['step1_ms']:.1f} ms for one "
            f"({steps['step8_ms'] / steps['step1_ms']:.2f}x: batching 8 buys at most {8 * steps['step1_ms'] / steps['step8_ms']:.2f}x); "
            f"steps that took in prompt tokens: {steps['prompt_share_c8']:.0%} of the c=8 cells' step time "
            "(medians over every such step of the run)."
            if steps
            else "- Batched steps: no decode step of 1 or of 8 sequences was seen."
        ),
        (
            f"- Batched p50 TPOT at c=1 over the floor: {b[1]['tpot_p50_ms']['median'] / median(floor_ms):.2f}x."
            if floor_ms
            else "- Floor not measured."
        ),
        f"- Batched p50 TPOT c=8 / c=1: {tpot_ratio:.2f}x (target <= 2x: {'met' if tpot_ratio <= 2 else 'NOT met'}).",
    ]
    for n, c in cross.items():
        lines.append(
            f"- Crossover vs {n}: c={c}: the batched baseline wins from here, so load.max_in_flight = {max(1, c - 1)}"
            + (" (the least the policy allows: speculation does not win even alone)" if c == 1 else "")
            if c
            else f"- Crossover vs {n}: none up to c={CONCURRENCY[-1]}"
        )
    raw = {
        "started_utc": started.isoformat(), "args": vars(args), "machine": machine, "drafters_loaded": setup.drafters,
        "summary": summary, "match_unbatched": match, "crossover": cross, "floor_ms": floor_ms,
        "curve": curve.model_dump() if curve else None, "batched_steps": steps,
        "batched_scaling_c8_over_c1": scaling, "batched_tpot_p50_c8_over_c1": tpot_ratio,
        "cells": {
            n: {c: [{k: v for k, v in cell.items() if k != "outputs"} for cell in cs] for c, cs in by_c.items()}
            for n, by_c in cells.items()
        },
    }
    return "\n".join(lines) + "\n", raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: one per core for llama.cpp)")
    ap.add_argument("--algorithms", default="ngram", help="comma-separated speculative algorithms to measure")
    args = ap.parse_args()
    machine = machine_record()
    tok = PromptTokenizer(CKPT, MAX_CONTEXT - args.tokens)
    prompts = [tok.encode_prompt(p.text) for p in load_prompts("chat", max(CONCURRENCY))]
    setup = build(args)
    started = datetime.now(timezone.utc)
    print(f"[bench-batching] {started:%Y-%m-%d %H:%M} UTC, {args.backend}, drafters loaded: {setup.drafters}, "
          f"measuring: {list(setup.configs)}", flush=True)
    try:
        cells, floor_ms = measure(setup, prompts, args, tok.eos_id)
    finally:
        for runner in setup.runners:
            runner.shutdown()
        if setup.floor is not None:
            setup.floor.close()
    md, raw = report(args, started, machine, setup, cells, floor_ms)
    print("\n" + md)
    write_results("bench-batching", md, raw)


if __name__ == "__main__":
    main()
