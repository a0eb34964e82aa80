"""`make bench` report: one Markdown file + PNG plots in results/report/, from real runs through Triton.

    python -m bench.report [--concurrency 1,2,4,8] [--max-tokens 48] [--per-worker 3] [--repeats 1]

Starts its own tritonserver (the default engines, rendered into artifacts/report/ with a copy of
policy/default.yaml, on ports 38010-38012) and drives it with a closed loop of HTTP generate_stream
clients: at concurrency c, c threads send the same fixed list of max(6, per_worker * c) greedy
requests (loadtest's built-in prompt mix, same seed for every scenario). Scenarios (per concurrency
level the first three run in a rotated order, so drift in the machine's load hits each of them):

- baseline: header `x-speculative-decoding: off`.
- gated: no header; the default policy decides (org mode prod, load gate, breaker, temperature).
- speculative: header `prod` under a policy copy with the load gate off and a breaker that never
  opens, and an API key of its own (a fresh breaker): speculation with no gates.
- mixed-temperature: as gated, half the requests at T >= 0.9 (one concurrency level, last, for the
  gate's reasons).

With --repeats R the plan of the first three runs R times, each time in another rotation; the tables
pool each scenario's R cells at a concurrency, and the c=8 batching check gives the median and the
range of the R ratios c=8 / c=1 (each repeat's c=1 and c=8 baseline cells were measured minutes apart).

Per cell: TTFT, TPOT and tokens/s as `loadtest.measure` defines them (the Locust users use the same
code), throughput = output tokens / the cell's wall time, and deltas of the gate's counters on the
metrics port. If results/bench-engine.json or results/bench-batching.json exist, their tables are
included (marked as those runs' numbers) and bench-engine's speedup and accepted tokens per step by
category are plotted.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS,
    ROOT,
    batching_bound_with_prompts,
    batching_check,
    machine_lines,
    machine_record,
    median,
    spread,
    wait_calibrated,
)
from loadtest import metrics  # noqa: E402
from loadtest.measure import Sample, timed  # noqa: E402
from loadtest.workloads import SCENARIOS, RequestSpec  # noqa: E402
from specgate.cost_model.calibration import Calibration  # noqa: E402
from specgate.cost_model.goodput import CostCurve  # noqa: E402
from specgate.gate.tenants import hash_key  # noqa: E402
from specgate_client import HttpClient  # noqa: E402
from specgate_launcher import Ports, running, server_env  # noqa: E402

OUT = RESULTS / "report"
WORK = ROOT / "artifacts" / "report"
SPEC_KEY = "report-speculative"  # the speculative scenario's own tenant: a breaker no other run touched
SPEC_TENANT = "report-speculative"  # its name in the report's key file
SERIES = ("baseline", "speculative", "gated")
SEED = 0
REQUEST_TIMEOUT_S = 120  # a request with no response this long counts as an error instead of stalling the cell
TOLERANCE = 0.05  # "worse" = more than 5% worse: single runs on a shared 2-core machine vary by that much


@dataclass
class Cell:
    scenario: str
    concurrency: int
    wall_s: float
    samples: list[Sample]
    gate: dict[str, dict[str, float]]
    repeat: int = 0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    @property
    def throughput(self) -> float:
        return sum(s.tokens for s in self.ok) / self.wall_s

    def tpot_ms(self) -> list[float]:
        return [1000 * s.tpot_s for s in self.ok if not math.isnan(s.tpot_s)]

    def ttft_ms(self) -> list[float]:
        return [1000 * s.ttft_s for s in self.ok]

    @property
    def speculative_share(self) -> float:
        return sum(s.route == "speculative" for s in self.ok) / max(len(self.ok), 1)


# -- server and policy ---------------------------------------------------------------------------
def render(dtype: str) -> dict[str, Any]:
    """Render the report's repository with its own policy file; returns the spec engine's config."""
    WORK.mkdir(parents=True, exist_ok=True)
    policy = WORK / "policy.yaml"
    policy.write_text((ROOT / "policy" / "default.yaml").read_text())
    (WORK / "tenants.yaml").write_text(f"{SPEC_TENANT}: [{hash_key(SPEC_KEY)}]\n")
    subprocess.run([sys.executable, "-m", "build.build_engines", "--dtype", dtype, "--out-dir", str(WORK), "--policy", str(policy)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((WORK / "engines" / "cpu" / "spec_engine.json").read_text())


def policies() -> tuple[dict, dict]:
    """(gated, speculative) policies: the shipped one (its `auto` algorithm picks among what the
    engine has), and the same with the load rule and breaker off."""
    gated = yaml.safe_load((ROOT / "policy" / "default.yaml").read_text())
    gated["key_file"] = "tenants.yaml"
    gated["tenants"] = {SPEC_TENANT: {"mode": "prod"}}
    spec = copy.deepcopy(gated)
    spec["load"]["max_in_flight"] = None
    spec["breaker"].update(min_samples=10**9, failure_threshold=10**9)
    return gated, spec


def apply_policy(policy: dict) -> None:
    path = WORK / "policy.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(policy))
    os.replace(tmp, path)  # atomic, as docs/gate.md asks
    time.sleep(1.5)  # the gate looks at the file's mtime at most once a second


# -- measurement ----------------------------------------------------------------------------------
def requests_for(scenario: str, n: int, max_tokens: int) -> list[RequestSpec]:
    """The same draws for every scenario (one seed): only the header, key and temperature differ."""
    wl = SCENARIOS[scenario].with_overrides(max_tokens=max_tokens, protocols={"http": 1.0})
    rng = random.Random(SEED)
    specs = [wl.sample(rng) for _ in range(n)]
    return [replace(s, api_key=SPEC_KEY) for s in specs] if scenario == "speculative" else specs


def closed_loop(url: str, specs: list[RequestSpec], concurrency: int) -> tuple[list[Sample], float]:
    """`concurrency` threads, each with its own client, take the next request until none are left."""
    it, lock, out = iter(specs), threading.Lock(), []

    def worker() -> None:
        client = HttpClient(url, timeout_s=REQUEST_TIMEOUT_S)
        while True:
            with lock:
                spec = next(it, None)
            if spec is None:
                return
            s = timed(client, spec)
            with lock:
                out.append(s)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def run_cell(scenario: str, c: int, ports: Any, args: argparse.Namespace, repeat: int = 0) -> Cell:
    murl = f"http://localhost:{ports.metrics}/metrics"
    before = metrics.scrape(murl)
    samples, wall = closed_loop(f"localhost:{ports.http}", requests_for(scenario, max(6, args.per_worker * c), args.max_tokens), c)
    cell = Cell(scenario, c, wall, samples, metrics.gate_deltas(before, metrics.scrape(murl)), repeat)
    print(f"[report] {scenario:<17} c={c}{f' (repeat {repeat + 1})' if args.repeats > 1 and scenario in SERIES else ''}: "
          f"{len(cell.ok)} ok, {cell.errors} errors, TPOT {spread(cell.tpot_ms())} ms, "
          f"{cell.throughput:.1f} tok/s, speculative {cell.speculative_share:.0%}, {wall:.0f}s", flush=True)
    return cell


# -- report ---------------------------------------------------------------------------------------
def head_stamp(head_dir: str | None) -> str | None:
    """Which EAGLE head the engine loaded: heads are retrained in place, so the file time matters."""
    files = sorted(Path(head_dir).glob("*.safetensors")) if head_dir else []
    if not files:
        return None
    stamp = datetime.fromtimestamp(files[0].stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{Path(head_dir).relative_to(ROOT) if Path(head_dir).is_relative_to(ROOT) else head_dir} (written {stamp})"


def pooled(cells: list[Cell]) -> list[Cell]:
    """One cell per (scenario, concurrency): the repeats' samples together, their walls and gate deltas summed."""
    out: dict[tuple[str, int], Cell] = {}
    for c in cells:
        p = out.setdefault((c.scenario, c.concurrency), Cell(c.scenario, c.concurrency, 0.0, [], {}))
        p.wall_s += c.wall_s
        p.samples += c.samples
        for key, deltas in c.gate.items():
            total = p.gate.setdefault(key, {})
            for k, v in deltas.items():
                total[k] = total.get(k, 0.0) + v
    return list(out.values())


def summed(cells: list[Cell], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in cells:
        for k, v in c.gate[key].items():
            out[k] = out.get(k, 0.0) + v
    return out


def plot_concurrency(cells: list[Cell], levels: list[int]) -> str:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sc in SERIES:
        by_c = {c.concurrency: c for c in cells if c.scenario == sc}
        xs = [x for x in levels if x in by_c]
        a.plot(xs, [median(by_c[x].tpot_ms()) for x in xs], marker="o", label=sc)
        b.plot(xs, [by_c[x].throughput for x in xs], marker="o", label=sc)
    for ax, title in ((a, "median TPOT (ms, lower is better)"), (b, "throughput (output tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return save(fig, "concurrency.png")


def plot_decisions(decisions: dict[str, dict[str, float]]) -> str:
    reasons = sorted({k for d in decisions.values() for k in d})
    fig, ax = plt.subplots(figsize=(9, 3.5))
    left = [0.0] * len(decisions)
    for r in reasons:
        vals = [decisions[s].get(r, 0.0) for s in decisions]
        ax.barh(list(decisions), vals, left=left, label=r.replace(",", ": "))
        left = [x + v for x, v in zip(left, vals)]
    ax.set_xlabel("requests (spec_gate_decisions_total delta)")
    ax.set_title("gate decisions by route: reason")
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, "gate_decisions.png")


def plot_positions(rates: dict[str, list[float]]) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(rates), 1)
    for i, (sc, r) in enumerate(rates.items()):
        ax.bar([p + i * width for p in range(len(r))], r, width, label=sc)
    ax.set_xlabel("draft position (0-based)")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("acceptance rate by draft position")
    ax.legend()
    return save(fig, "acceptance_by_position.png")


def plot_engine(engine: dict) -> str | None:
    """bench-engine's T=0 (else first temperature) median speedup and accepted/step, per category."""
    results = engine.get("results") or {}
    if not results:
        return None
    temp = "0.0" if "0.0" in results else next(iter(results))
    cats = [c for c in results[temp] if c != "overall"]
    routes = [r["route"] for r in results[temp][cats[0]] if r["route"] != "baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(routes), 1)
    for ax, key, title in ((axes[0], "median_speedup", "speedup over baseline (median)"),
                           (axes[1], "accepted_per_step", "tokens per verification step")):
        for i, route in enumerate(routes):
            vals = [next((r.get(key) or 0.0 for r in results[temp][c] if r["route"] == route), 0.0) for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=route)
        ax.set_xticks([x + width * (len(routes) - 1) / 2 for x in range(len(cats))], cats)
        ax.set_title(f"bench-engine, T={temp}: {title}")
        ax.legend(fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    return save(fig, "engine_by_category.png")


def save(fig: Any, name: str) -> str:
    fig.tight_layout()
    fig.savefig(OUT / name, dpi=110)
    plt.close(fig)
    return name


def pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%" if b and not math.isnan(b) else "n/a"  # b = 0 when every request of a cell failed


def checks(cells: list[Cell], levels: list[int], repeats: list[Cell], curve: CostCurve | None) -> list[str]:
    """The issue's claims, stated from this run's medians (`cells` pooled over the `repeats`); `curve`:
    spec_engine's start-up calibration of the report's server (None if it failed)."""
    get = {(c.scenario, c.concurrency): c for c in cells}
    out = ["Gated vs baseline at each concurrency (TPOT: lower is better; throughput: higher is better):", ""]
    worse = []
    for x in levels:
        g, b, s = get[("gated", x)], get[("baseline", x)], get[("speculative", x)]
        gt, bt, st = median(g.tpot_ms()), median(b.tpot_ms()), median(s.tpot_ms())
        if gt > bt * (1 + TOLERANCE) or g.throughput < b.throughput * (1 - TOLERANCE):
            worse.append(x)
        out.append(f"- c={x}: gated TPOT {gt:.1f} ms vs baseline {bt:.1f} ({pct(gt, bt)}) and speculative {st:.1f} ({pct(gt, st)}); "
                   f"throughput {g.throughput:.1f} vs baseline {b.throughput:.1f} ({pct(g.throughput, b.throughput)}) and "
                   f"speculative {s.throughput:.1f}; gated served {g.speculative_share:.0%} speculative")
    out += ["", f"**Gated never worse than baseline (TPOT and throughput within {TOLERANCE:.0%}): "
            f"{'yes' if not worse else 'NO at c=' + ', '.join(map(str, worse))}** "
            "(medians of each scenario's pooled cells; the machine's noise is of that order)."]
    if {1, 8} <= set(levels):
        base = {(c.repeat, c.concurrency): c.throughput for c in repeats if c.scenario == "baseline"}
        ratios = [base[(r, 8)] / base[(r, 1)] for r in sorted({r for r, _ in base})]
        note = "one cell each" if len(ratios) == 1 else f"median of {len(ratios)} repeats, [{min(ratios):.2f}-{max(ratios):.2f}]x"
        out.append(f"**The baseline through Triton, {batching_check(median(ratios), curve)}** "
                   f"({note}; the curve is spec_engine's start-up calibration of this server, read before the first cell.)")
        if curve is not None:
            one = [c for c in repeats if c.scenario == "baseline" and c.concurrency == 1]
            ttft = median([t for c in one for t in c.ttft_ms()])
            tokens = median([s.tokens for c in one for s in c.ok])
            bound = batching_bound_with_prompts(ttft, median([t for c in one for t in c.tpot_ms()]), tokens, curve)
            out.append(f"  - Counting the prompts (c=1 baseline: TTFT {ttft:.0f} ms, then {tokens:.0f} tokens at its TPOT; "
                       f"bench.common.batching_bound_with_prompts), the curve allows {bound:.2f}x: measured "
                       f"{median(ratios) / bound:.2f} of it.")
    if 1 in levels:
        g, s = median(get[("gated", 1)].tpot_ms()), median(get[("speculative", 1)].tpot_ms())
        out.append(f"**Single stream (c=1, T=0): gated TPOT {g:.1f} ms vs speculative {s:.1f} ms ({pct(g, s)}): "
                   f"{'at most' if g <= s * 1.05 else 'NOT at most'} 5% slower.**")
    return out


def calibrated_curve(published: Path | None) -> CostCurve | None:
    """The cost curve in the calibration spec_engine of the report's server published (None if none).

    Read once, before the first cell: while serving, the engine refines the curve from its own
    decodes (cost_model/live.py), and those correct only the sizes it verifies, cost(1) above all.
    Served decodes share the cores with the response path, so a refined cost(1) against a start-up
    cost(8) moved the c=8 bar from 1.10x to 0.95x within one run on an Ice Lake Xeon. The start-up
    curve measures every size in one pass, under the same conditions."""
    return Calibration.load(published).curve if published is not None else None


def why_defaults(meta: dict[str, Any]) -> list[str]:
    """Where the gated policy's load rule and the server's threading come from."""
    g = meta["policies"]["gated"]
    _, batching = included("bench-batching")
    crossover = (batching or {}).get("crossover") or {}
    measured = (
        (f"this machine's latest `make bench-batching` ({batching['started_utc'][:16]} UTC) found the crossover at "
         + ", ".join(f"c={c} against {alg}" for alg, c in crossover.items()))
        if crossover
        else "run `make bench-batching` to measure the crossover here"
    )
    omp = ", ".join(f"{k}={v}" for k, v in sorted(meta["openmp"].items()))
    return [
        "## Why the defaults are what they are", "",
        f"- `load.max_in_flight: {g['load']['max_in_flight']}`: speculate only while fewer requests are in flight. The speculative "
        "engine serves one sequence at a time, the baseline batches; from the concurrency where batched throughput overtakes "
        f"speculation (the crossover c), the second request should go to the baseline, so the limit is c - 1. {measured}.",
        f"- `temperature_threshold: {g['temperature_threshold']}`: above it drafts are rejected more often than they pay "
        "(bench-engine's T=0.7 column shows the loss); the mixed-temperature row shows those requests on the baseline.",
        f"- server processes run with {omp} (`specgate_launcher.server_env`): the PyTorch engine's one thread per stub; "
        "llama.cpp sets its own threads (one per core), and the engines take turns per decode (docs/engines.md, "
        "\"Threads, and engines that take turns\").",
    ]


def included(name: str) -> tuple[list[str], dict | None]:
    """Another benchmark's own Markdown (its tables, from its run) and JSON, if it has been run."""
    md, js = RESULTS / f"{name}.md", RESULTS / f"{name}.json"
    if not js.exists():
        return [], None
    stamp = datetime.fromtimestamp(js.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = md.read_text().replace("\n# ", "\n#### ").replace("\n## ", "\n#### ") if md.exists() else "(no Markdown next to the JSON)"
    body = body[2:] if body.startswith("# ") else body
    lines = [f"### {name} (its own run: results/{name}.json, written {stamp}; not measured by this report)", "", body.strip(), ""]
    return lines, json.loads(js.read_text())


def write_report(repeats: list[Cell], levels: list[int], args: argparse.Namespace, meta: dict[str, Any], curve: CostCurve | None) -> Path:
    cells = pooled(repeats)
    md = [
        "# specgate report: load, gate and acceptance through Triton", "",
        f"- date: {meta['date']}; {meta['minutes']:.1f} min of measurement",
        *machine_lines(meta["machine"]),
        f"- load average {meta['load_start']:.1f} at start, "
        f"{meta['load_end']:.1f} at end"
        + (" (**shared with other jobs**: numbers are noisier and slower than on an idle machine)" if meta["shared"] else ""),
        f"- engines: {meta['engine']['backend']} ({meta['engine']['model']}), dtype {meta['dtype']}; "
        f"speculative algorithm {meta['algorithm']}, {meta['k'] or 'the engine default of'} draft tokens; "
        "baseline engine batches up to 8, the speculative engine serves one sequence at a time",
        f"- requests: greedy (T=0) except mixed-temperature, up to {args.max_tokens} new tokens, HTTP generate_stream, "
        f"loadtest's built-in prompt mix (loadtest/workloads.py), max(6, {args.per_worker} x c) requests per cell, closed loop"
        + (f"; {args.repeats} repeats of every cell but mixed-temperature, pooled in the tables" if args.repeats > 1 else ""),
        "- TPOT = (last chunk - first token) / (tokens - 1) per request; TTFT = first token; throughput = output tokens / cell wall time",
        f"- reproduce: `make bench` (report step: `{meta['command']}`)",
    ]
    g = meta["policies"]["gated"]
    md.append(f"- gated policy (policy/default.yaml as of this run): mode {g['mode']}, "
              f"temperature > {g['temperature_threshold']} -> baseline, "
              f"load.max_in_flight {g['load']['max_in_flight']}, breaker opens below {g['breaker']['open_threshold']} acceptance EMA "
              f"after {g['breaker']['min_samples']} requests (cooldown {g['breaker']['cooldown_s']} s)")
    if meta["eagle_head"]:
        md.append(f"- EAGLE head: {meta['eagle_head']}")
    md += ["", "## TPOT and throughput against concurrency", "", f"![concurrency]({plot_concurrency(cells, levels)})", "",
           "| scenario | c | requests | errors | speculative | TTFT p50 ms | TPOT ms, median [min-max] | throughput tok/s |",
           "|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c.scenario, c.concurrency)):
        md.append(f"| {c.scenario} | {c.concurrency} | {len(c.samples)} | {c.errors} | {c.speculative_share:.0%} | "
                  f"{median(c.ttft_ms()):.0f} | {spread(c.tpot_ms())} | {c.throughput:.1f} |")
    md += ["", "## Checks", "", *checks(cells, levels, repeats, curve), "", *why_defaults(meta), ""]

    decisions = {sc: summed([c for c in cells if c.scenario == sc], "decisions") for sc in dict.fromkeys(c.scenario for c in cells)}
    md += ["## Gate decisions by reason", "", "Deltas of `spec_gate_decisions_total{route,reason}` over each scenario's cells.", "",
           f"![decisions]({plot_decisions(decisions)})", "", "| scenario | route: reason | requests |", "|---|---|---|"]
    md += [f"| {sc} | {k.replace(',', ': ')} | {v:.0f} |" for sc, d in decisions.items() for k, v in d.items()]

    rates: dict[str, list[float]] = {}
    md += ["", "## Acceptance by draft position", "",
           "Deltas of `spec_decode_num_accepted_tokens_per_pos_total{position}` / `spec_decode_num_drafts_total` over each scenario.", "",
           "| scenario | drafts | draft tokens | accepted | acceptance rate | mean acceptance length | per position |",
           "|---|---|---|---|---|---|---|"]
    for sc in dict.fromkeys(c.scenario for c in cells):
        sc_cells = [c for c in cells if c.scenario == sc]
        t, per = summed(sc_cells, "totals"), summed(sc_cells, "accepted_per_position")
        if not t.get("num_drafts"):
            continue
        positions = max([meta["k"] or 0, *(int(p) + 1 for p in per)])  # k None: the engine's default
        rates[sc] = [per.get(str(i), 0.0) / t["num_drafts"] for i in range(positions)]
        md.append(f"| {sc} | {t['num_drafts']:.0f} | {t['num_draft_tokens']:.0f} | {t['num_accepted_tokens']:.0f} | "
                  f"{t['num_accepted_tokens'] / max(t['num_draft_tokens'], 1):.2f} | "
                  f"{1 + t['num_accepted_tokens'] / t['num_drafts']:.2f} | "
                  + ", ".join(f"{r:.2f}" for r in rates[sc]) + " |")
    if rates:
        md += ["", f"![acceptance by position]({plot_positions(rates)})"]

    others = []
    for name in ("bench-engine", "bench-batching"):
        lines, data = included(name)
        others += lines
        if name == "bench-engine" and data and (png := plot_engine(data)):
            others += [f"![engine by category]({png})", ""]
    if others:
        md += ["", "## Other benchmarks (included as they were written)", "", *others]

    path = OUT / "report.md"
    path.write_text("\n".join(md) + "\n")
    (OUT / "runs.json").write_text(
        json.dumps({"meta": meta, "cells": [{**asdict(c), "samples": [asdict(s) for s in c.samples]} for c in repeats]}, indent=1)
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-worker", type=int, default=3, help="requests per client thread in a cell (at least 6 per cell)")
    ap.add_argument("--repeats", type=int, default=1, help="times every cell but mixed-temperature runs, each time in another rotation")
    ap.add_argument("--mixed-concurrency", type=int, default=2, help="concurrency of the single mixed-temperature cell")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="the EAGLE head (and a torch engine)")
    ap.add_argument("--ports", default="38010,38011,38012", help="HTTP,gRPC,metrics for the report's own server")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    engine = render(args.dtype)
    gated, spec = policies()
    apply_policy(gated)
    http, grpc, mport = (int(p) for p in args.ports.split(","))
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    started = datetime.now(timezone.utc)
    cells: list[Cell] = []
    ports = Ports(http, grpc, mport)
    # the server's log goes with the report it produced
    with running(WORK / "model_repository", ports, OUT / "server.log"):
        curve = calibrated_curve(wait_calibrated(WORK / "model_repository"))
        url = f"localhost:{ports.http}"
        # warm-up off the measured cells (first-call allocations, batch shapes); SPEC_KEY keeps the org breaker fresh
        closed_loop(url, [replace(s, api_key=SPEC_KEY) for s in requests_for("baseline", 4, args.max_tokens)], 2)
        closed_loop(url, requests_for("speculative", 2, args.max_tokens), 1)
        active = gated
        # rotated per level and per repeat: load drift hits every series
        plan = [(sc, c, r) for r in range(args.repeats) for i, c in enumerate(levels)
                for sc in SERIES[(i + r) % 3:] + SERIES[: (i + r) % 3]]
        for sc, c, r in [*plan, ("mixed-temperature", args.mixed_concurrency, 0)]:
            if (want := spec if sc == "speculative" else gated) is not active:
                apply_policy(want)
                active = want
            cells.append(run_cell(sc, c, ports, args, r))
    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "minutes": (time.perf_counter() - t0) / 60, "machine": machine_record(),
        "engine": engine,
        # load before our own server starts: >= 1 means other jobs held at least a core
        "load_start": load_start, "load_end": os.getloadavg()[0], "shared": load_start >= 1.0,
        "dtype": engine["dtype"], "algorithm": gated["speculative"]["algorithm"], "k": gated["speculative"]["num_speculative_tokens"],
        "eagle_head": head_stamp(engine.get("eagle_head_dir")), "command": "python -m bench.report " + " ".join(sys.argv[1:]),
        "policies": {"gated": gated, "speculative": spec},
        "openmp": {k: v for k, v in server_env().items() if k.startswith(("OMP_", "GOMP_"))},
    }
    print(f"[report] wrote {write_report(cells, levels, args, meta, curve)}")


if __name__ == "__main__":
    main()
