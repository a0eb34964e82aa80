"""`make bench-batching`: in-flight batching vs no batching vs speculation, at concurrency 1, 2, 4, 8.

Configurations, all driven in-process (no Triton), same weights, dtype and prompts, greedy:
- batched:     BatchRunner, max_batch_size=8 (the baseline engine as served)
- unbatched:   BatchRunner, max_batch_size=1 (requests queue, one at a time)
- spec-<alg>:  SpeculativeRunner (one sequence at a time, FIFO) for each measured algorithm

A cell (configuration x concurrency c) submits the first c of 8 chat prompts of the project's
benchmark set (bench/prompts.py, chat template) at once, up to --tokens new tokens each (EOS ends a
request early), and waits for all of them. Throughput = all output tokens / the cell's wall time.
TPOT per request = time from its first to its last token / tokens after the first (queueing shows
up in TTFT, not TPOT). Every repeat runs every cell once, in a rotated order, so
machine noise spreads over all configurations; the table gives median [min-max] over repeats.

Crossover: the lowest c at which batched throughput (median) exceeds the speculative engine's. The
gate's `load.max_in_flight` counts requests already in flight, so it should be crossover - 1.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from bench.common import ROOT, median, spread, write_results
from bench.prompts import load_prompts
from specgate.engine.config import EngineConfig
from specgate.engine.model import load_llama
from specgate.engine.request import Event, GenerationRequest
from specgate.engine.runner import BatchRunner
from specgate.speculative.runner import SpeculativeRunner
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: as the server runs each engine, specgate.launcher; 0 = torch default)")
    ap.add_argument("--algorithms", default=None, help="comma-separated speculative algorithms (default: the engine's default algorithm, and ngram)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = PromptTokenizer(CKPT, MAX_CONTEXT - args.tokens)
    prompts = [tok.encode_prompt(p.text) for p in load_prompts("chat", max(CONCURRENCY))]
    model = load_llama(CKPT, getattr(torch, args.dtype), MAX_CONTEXT)
    # Waiting is part of what is measured (TTFT): no request may time out in a queue.
    base = {"checkpoint_dir": CKPT, "dtype": args.dtype, "max_context": MAX_CONTEXT, "queue_timeout_s": 1e6}
    has_head = (HEAD / "eagle_head.safetensors").exists()
    # The spec engine as build_engines configures it: every drafter whose weights exist.
    spec_cfg = EngineConfig(
        **base,
        max_batch_size=1,
        draft_model_dir=DRAFT if (DRAFT / "model.safetensors").exists() else None,
        eagle_head_dir=HEAD if has_head else None,
        default_algorithm="hybrid" if has_head else "ngram",
    )
    spec = SpeculativeRunner(model, spec_cfg)
    algorithms = args.algorithms.split(",") if args.algorithms else list(dict.fromkeys([spec_cfg.default_algorithm, "ngram"]))
    loaded = sorted(spec.generator.drafters)
    batched = BatchRunner(model, EngineConfig(**base, max_batch_size=8))
    unbatched = BatchRunner(model, EngineConfig(**base, max_batch_size=1))
    configs: dict[str, Submit] = {"batched": batched.submit, "unbatched": unbatched.submit}
    for alg in algorithms:
        configs[f"spec-{alg}"] = lambda r, emit, alg=alg: spec.submit(r, emit, algorithm=alg)

    started = datetime.now(timezone.utc)
    print(f"[bench-batching] {started:%Y-%m-%d %H:%M} UTC, {args.dtype}, threads={torch.get_num_threads()}, "
          f"drafters loaded: {loaded}, measuring: {list(configs)}", flush=True)
    for submit in configs.values():  # warm-up: first-call allocations and kernel selection
        run_cell(submit, prompts[:2], 8, tok.eos_id)

    cells: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in CONCURRENCY} for name in configs}
    names = list(configs)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for c in CONCURRENCY:
            for name in order:
                cell = run_cell(configs[name], prompts[:c], args.tokens, tok.eos_id)
                cells[name][c].append(cell)
                print(f"  rep {rep + 1} c={c} {name:14s} {cell['tok_s']:6.1f} tok/s  {cell['tokens']} tokens in {cell['wall_s']:.1f}s", flush=True)
    for runner in (batched, unbatched, spec):
        runner.shutdown()

    summary = {name: {c: summarize(cells[name][c]) for c in CONCURRENCY} for name in configs}
    # bf16 argmax can flip between batch shapes, so report how often outputs equal the unbatched ones.
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
    specs = [n for n in configs if n.startswith("spec-")]
    cross = {n: crossover(summary, n) for n in specs}
    b = summary["batched"]
    scaling = b[8]["tok_s"]["median"] / b[1]["tok_s"]["median"]
    tpot_ratio = b[8]["tpot_p50_ms"]["median"] / b[1]["tpot_p50_ms"]["median"]

    lines = [
        f"bench-batching: {started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {torch.get_num_threads()} torch threads, "
        f"{args.dtype}, greedy, up to {args.tokens} new tokens, {args.repeats} repeats, median [min-max]. "
        f"Drafters loaded: {', '.join(loaded)}.",
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
        f"- Batched throughput c=8 / c=1: {scaling:.2f}x (target >= 4x: {'met' if scaling >= 4 else 'NOT met'}).",
        f"- Batched p50 TPOT c=8 / c=1: {tpot_ratio:.2f}x (target <= 2x: {'met' if tpot_ratio <= 2 else 'NOT met'}).",
    ]
    for n, c in cross.items():
        lines.append(
            f"- Crossover vs {n}: c={c}: the batched baseline wins from here, so load.max_in_flight = {max(1, c - 1)}"
            + (" (the least the policy allows: speculation does not win even alone)" if c == 1 else "")
            if c
            else f"- Crossover vs {n}: none up to c={CONCURRENCY[-1]}"
        )
    md = "\n".join(lines) + "\n"
    print("\n" + md)
    raw = {
        "started_utc": started.isoformat(),
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "drafters_loaded": loaded,
        "summary": summary,
        "match_unbatched": match,
        "crossover": cross,
        "batched_scaling_c8_over_c1": scaling,
        "batched_tpot_p50_c8_over_c1": tpot_ratio,
        "cells": {n: {c: [{k: v for k, v in cell.items() if k != "outputs"} for cell in cs] for c, cs in by_c.items()} for n, by_c in cells.items()},
    }
    write_results("bench-batching", md, raw)


if __name__ == "__main__":
    main()
