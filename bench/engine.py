"""`make bench-engine`: every speculative algorithm against the baseline engine and the peer, in one run.

For each temperature (0 and 0.7), each prompt category of bench/prompts.py and overall:

    | route | acceptance rate | accepted/step | budget | TPOT ms | speedup vs baseline | vs peer |

- peer: llama-cpp-python's own plain decoding of the same GGUF, threads and prompts (bench/peer.py);
  only with the llama.cpp engine.
- baseline: the baseline engine's target and sampling, one request at a time (decoding/plain.py).
  Every llama.cpp decode of this process runs on its main thread: a second thread's OpenMP pool
  (the batch runner's) made every decode 2x slower (each engine process of the server decodes on
  one thread).
- floor: a bare loop of plain one-token decodes, which the calibration measures beside the curve
  in this process (printed with the calibration, below the curves).
- no drafts: the speculative engine with a drafter that never has anything to propose, so every
  step chooses a budget, verifies the root alone and keeps the books: what its loop costs beyond
  plain decoding, the most a request it serves can lose where nothing drafts.
- each algorithm: the speculative engine as served, calibrated on this machine (cost_model/
  measure.py), so each step drafts the budget that pays, down to nothing.
- gated: what the gate decides for a single request with the shipped policy and this calibration
  (route and algorithm), run on the engine it picks, its stats fed back to the gate as spec_gate
  does (so the tenant's breaker opens where the route buys nothing, and probes).
- Runs are interleaved per prompt in an order rotated per prompt, so machine noise hits all alike;
  with --repeats N every prompt runs all routes N times (each time in another order) and each
  route keeps its median run. Generation stops at EOS or after --tokens new tokens.
- acceptance rate = accepted / draft tokens and accepted/step = 1 + accepted / drafts, pooled over
  the row's prompts; budget = mean draft nodes per verification step (0: decoded plainly).
- TPOT = (last - first token) / (tokens - 1) per request; speedups are paired per prompt; both
  median [min-max] over the row's prompts.
- T=0 identity: outputs equal to the baseline's token for token; at each first divergence, the logit
  gap between the two tokens (a near-tie that the cache layout or batch shape can flip).
- Checks: gated against the best of baseline and each algorithm per row, with a 90% bootstrap
  interval over the row's prompts: on a machine whose speed drifts by a third from second to
  second, a row of a few prompts cannot resolve a few percent, and the interval says so.

    python -m bench.engine --per-category 6 --tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import time
from dataclasses import dataclass, field

from torch import Tensor

from bench.common import GGUF, ROOT, machine_lines, machine_record, median, median_run, spread, tpot_ms, write_results
from bench.peer import Peer
from bench.prompts import CATEGORIES, load_prompts
from specgate.algorithms import ALGORITHMS
from specgate.cost_model.goodput import CostCurve
from specgate.cost_model.measure import calibrate, measure
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.plain import plain_decode
from specgate.decoding.sampling import SamplingParams
from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.gate import Gate, RequestInputs, Route
from specgate.speculative import SpecStats, SpeculativeGenerator
from specgate.speculative.drafter import Drafter
from specgate.speculative.registry import build_drafters
from specgate.text.tokenizer import PromptTokenizer

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
DRAFT = {"llamacpp": GGUF.with_name(f"{GGUF.stem}.draft-4L.gguf"), "torch": ROOT / "artifacts" / "checkpoints" / "smollm2-135m-draft"}
HEAD = ROOT / "heads" / "smollm2-135m-eagle"
POLICY = ROOT / "policy" / "default.yaml"
MAX_LEN = 1024  # prompts are capped at ~600 tokens; room for the output and a draft tree
NO_DRAFTS = "no drafts"


class NothingToDraft(Drafter):
    """Proposes nothing, ever: the speculative loop's own cost (the `no drafts` row)."""

    name = "ngram"  # priced and tracked as prompt lookup, whose drafting costs least

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        return DraftTree.empty()


@dataclass
class Run:
    """One request: emitted tokens, per-token time, speculative stats."""

    tokens: list[int]
    tpot_ms: float
    stats: SpecStats = field(default_factory=SpecStats)
    steps: int = 0  # verification steps (drafted or not)


def run_baseline(target: Target, ids: list[int], n: int, params: SamplingParams, eos: int) -> Run:
    times: list[float] = []
    tokens = plain_decode(target, ids, n, params, eos, on_token=lambda _: times.append(time.perf_counter()))
    return Run(tokens, tpot_ms(times, len(tokens)))


def run_spec(gen: SpeculativeGenerator, algorithm: str, ids: list[int], n: int, params: SamplingParams) -> Run:
    stream = gen.generate(ids, n, params, algorithm=algorithm)
    tokens: list[int] = []
    times: list[float] = []
    steps = 0
    for block in stream:
        times.append(time.perf_counter())
        tokens += block
        steps += 1
    return Run(tokens, tpot_ms(times, len(tokens)), stream.stats, steps)


# -- the benchmark -----------------------------------------------------------------------------
def summarize(runs: dict[str, list[tuple[Run, Run]]]) -> list[dict]:
    """One row per route from its (baseline run, route run) pairs."""
    rows = []
    for name, pairs in runs.items():
        tpot = [r.tpot_ms for _, r in pairs if not math.isnan(r.tpot_ms)]
        speed = [b.tpot_ms / r.tpot_ms for b, r in pairs if not (math.isnan(b.tpot_ms) or math.isnan(r.tpot_ms))]
        drafts = sum(r.stats.num_drafts for _, r in pairs)
        draft_tokens = sum(r.stats.draft_tokens for _, r in pairs)
        accepted = sum(r.stats.accepted_tokens for _, r in pairs)
        steps = sum(r.steps for _, r in pairs)
        rows.append(
            {
                "route": name,
                "prompts": len(pairs),
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "accepted_per_step": 1 + accepted / drafts if drafts else None,
                "budget": draft_tokens / steps if steps else None,
                "tpot_ms": tpot,
                "speedup": speed,
                "median_tpot_ms": median(tpot),
                "median_speedup": median(speed),
            }
        )
    return rows


def table(rows: list[dict], peer_tpot: float | None) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| route | acceptance rate | accepted/step | budget | TPOT ms | speedup vs baseline | vs peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_peer = f"{peer_tpot / r['median_tpot_ms']:.2f}" if peer_tpot else "-"
        lines.append(
            f"| {r['route']} | {f(r['acceptance_rate'], '.2f')} | {f(r['accepted_per_step'], '.2f')} | {f(r['budget'], '.2f')} | "
            f"{spread(r['tpot_ms'])} | {_ratio(r['speedup'])} | {vs_peer} |"
        )
    return "\n".join(lines)


def _ratio(xs: list[float]) -> str:
    """`spread` with two decimals: a speedup of 0.96 must not read as 1.0."""
    return f"{median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "n/a"


def _speed(row: dict, idx: list[int] | None = None) -> float:
    """A row's median speedup over baseline (over the prompts `idx`, default all); baseline is 1."""
    if row["route"] == "baseline":
        return 1.0
    return median(row["speedup"] if idx is None else [row["speedup"][i] for i in idx])


def gated_vs_best(rows: list[dict], draws: int = 2000, seed: int = 0) -> tuple[str, float, float, float] | None:
    """(best route, gated/best, and its 90% bootstrap interval over the row's prompts), the best
    being chosen anew in every resample (so the interval carries the max-of-noisy-routes bias)."""
    by = {r["route"]: r for r in rows}
    gated = by.get("gated")
    candidates = [r for r in rows if r["route"] not in ("gated", "peer", NO_DRAFTS)]
    if gated is None or any(len(r["speedup"]) != len(gated["speedup"]) for r in candidates if r["route"] != "baseline"):
        return None
    best = max(candidates, key=_speed)
    rng = random.Random(seed)
    n = len(gated["speedup"])
    ratios = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(_speed(gated, idx) / max(_speed(r, idx) for r in candidates))
    ratios.sort()
    return best["route"], _speed(gated) / _speed(best), ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def targets(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The issue's checks on this run, each with whether it holds."""
    out = []
    for temp, cats in results.items():
        for cat, rows in cats.items():
            by = {r["route"]: r for r in rows}
            found = gated_vs_best(rows)
            if found is None:
                continue
            best, ratio, lo, hi = found
            gated = _speed(by["gated"])
            verdict = "MET" if ratio >= 0.97 else "MISSED"
            out.append(
                f"- T={temp} {cat}: gated {gated:.2f}x baseline, best {best} {_speed(by[best]):.2f}x: gated/best {ratio:.2f} "
                f"(90% interval {lo:.2f}-{hi:.2f}; target >= 0.97): **{verdict}**"
            )
            if gated < 0.97:
                out.append(f"  - the gated route is slower than baseline here ({gated:.2f}x)")
    return out


@dataclass
class Routes:
    """Every route of the run over the same prompts: `run(name, prompt, params)` is one request."""

    baseline: Target
    gen: SpeculativeGenerator
    no_drafts: SpeculativeGenerator  # on the same target, with NothingToDraft
    gate: Gate
    peer: Peer | None
    ids: list[list[int]]
    tokens: int
    names: list[str]
    decisions: list[str] = field(default_factory=list)

    def run(self, name: str, i: int, params: SamplingParams) -> Run:
        eos = self.baseline.info.eos_token_id
        if name == "peer":
            assert self.peer is not None
            r = self.peer.run(self.ids[i], self.tokens, params.temperature, params.seed or 0, eos)
            return Run(r.tokens, r.tpot_ms)
        if name == "gated":  # as spec_gate does: decide, run on the chosen engine, feed the stats back
            d = self.gate.decide(RequestInputs(temperature=params.temperature, prompt_tokens=len(self.ids[i])))
            speculative = d.route is Route.SPECULATIVE
            self.decisions.append(d.algorithm if speculative else f"baseline ({d.reason})")
            run = self.run(d.algorithm if speculative else "baseline", i, params)
            if speculative:
                self.gate.record_speculative(d, run.stats)
            self.gate.finish(d)
            return run
        if name == "baseline":
            return run_baseline(self.baseline, self.ids[i], self.tokens, params, eos)
        if name == NO_DRAFTS:
            return run_spec(self.no_drafts, NothingToDraft.name, self.ids[i], self.tokens, params)
        return run_spec(self.gen, name, self.ids[i], self.tokens, params)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6, help="prompts per category (of 200)")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per request")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="torch engine only")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: one per core)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every route per prompt; each keeps its median")
    ap.add_argument("--name", default="bench-engine", help="results/<name>.md and .json")
    return ap.parse_args()


def measure_temperature(routes: Routes, prompts: list, temp: float, repeats: int) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every route on every prompt `repeats` times at one temperature: rows per category, and the raw runs."""
    names = routes.names
    per: dict[str, dict[str, list[tuple[Run, Run]]]] = {c: {n: [] for n in names} for c in CATEGORIES}
    raw: list[dict] = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temp, seed=i)
        tries: dict[str, list[Run]] = {n: [] for n in names}
        for r in range(repeats):
            shift = (i * repeats + r) % len(names)  # rotate: no fixed position in the sequence
            for n in names[shift:] + names[:shift]:
                tries[n].append(routes.run(n, i, params))
        got = {n: median_run(tries[n]) for n in names}
        for n in names:
            per[p.category][n].append((got["baseline"], got[n]))
        raw.append({"category": p.category, "prompt": i, "prompt_tokens": len(routes.ids[i])} | {
            n: {"tokens": len(r.tokens), "tpot_ms": r.tpot_ms, "drafts": r.stats.num_drafts, "accepted": r.stats.accepted_tokens,
                "draft_tokens": r.stats.draft_tokens, "steps": r.steps, "output": r.tokens} for n, r in got.items()})
        print(f"[T={temp}] {i + 1}/{len(prompts)} {p.category}: " + ", ".join(f"{n} {r.tpot_ms:.1f}ms" for n, r in got.items()), flush=True)
    cats = {c: summarize(per[c]) for c in CATEGORIES}
    cats["overall"] = summarize({n: [pair for c in CATEGORIES for pair in per[c][n]] for n in names})
    return cats, raw


def main() -> None:
    args = parse_args()
    algorithms = [a for a in args.algorithms.split(",") if a]
    temps = [float(t) for t in args.temperatures.split(",")]
    load_start = os.getloadavg()
    machine = machine_record()

    model = GGUF if args.backend == "llamacpp" else CKPT
    cfg = EngineConfig(
        backend=args.backend, model=model, dtype=args.dtype, num_threads=args.threads, max_context=MAX_LEN, max_batch_size=1,
        draft_model=DRAFT[args.backend] if "draft_model" in algorithms else None,
        eagle_head_dir=HEAD if {"eagle", "eagle2", "hybrid"} & set(algorithms) else None, queue_timeout_s=1e6,
    )
    tok = PromptTokenizer(CKPT, MAX_LEN - args.tokens - 80)  # room for the output and a draft tree
    prompts = load_prompts(limit_per_category=args.per_category)
    # both targets in the mode the server runs (cfg.exact), as engine_model loads them
    target = load_target(cfg, model, num_slots=1, tree_nodes=max(ALGORITHMS[a].max_k for a in algorithms), exact=cfg.exact)
    drafters = {k: v for k, v in build_drafters(target, cfg).items() if k in algorithms}
    cal = calibrate(target, drafters)
    gen = SpeculativeGenerator(target, drafters, cal.curve)
    for name in cal.algorithms:
        gen.draft_cost[name] = cal.draft_cost(name)
    no_drafts = SpeculativeGenerator(target, {NothingToDraft.name: NothingToDraft()}, cal.curve)
    curves = {f"{args.backend} (served)": cal.curve, **other_curve(args)}
    peer = Peer(GGUF, MAX_LEN, cfg.threads) if args.backend == "llamacpp" else None
    routes = Routes(
        baseline=load_target(cfg, model, num_slots=1, exact=cfg.exact), gen=gen, no_drafts=no_drafts, gate=Gate(POLICY, calibration=cal),
        peer=peer, ids=[tok.encode_prompt(p.text) for p in prompts], tokens=args.tokens,
        names=["baseline", NO_DRAFTS, *drafters, "gated"] + (["peer"] if peer else []),
    )
    for name in routes.names:  # warm-up: first-call allocations and kernel selection
        routes.run(name, 0, SamplingParams())
    results: dict[str, dict[str, list[dict]]] = {}
    raw_runs: dict[str, list[dict]] = {}
    identity: dict[str, dict] = {}
    t_start = time.perf_counter()
    for temp in temps:
        results[str(temp)], raw_runs[str(temp)] = measure_temperature(routes, prompts, temp, args.repeats)
        if temp == 0.0:
            identity = greedy_identity(target, routes.ids, raw_runs[str(temp)], [n for n in routes.names if n != "baseline"])
    elapsed = time.perf_counter() - t_start

    md = report(args, machine, prompts, results, identity, curves, cal.summary(), load_start, elapsed, routes.decisions)
    print("\n" + md)
    write_results(args.name, md, {"args": vars(args), "machine": machine, "calibration": cal.model_dump(mode="json"),
                                  "curves": {k: c.model_dump() for k, c in curves.items()}, "results": results,
                                  "identity": identity, "gate_decisions": routes.decisions, "runs": raw_runs})


def other_curve(args: argparse.Namespace) -> dict[str, CostCurve]:
    """The other engine's cost curve on this machine, for the table (torch in its auto dtype, or llama.cpp)."""
    other = "torch" if args.backend == "llamacpp" else "llamacpp"
    cfg = EngineConfig(backend=other, model=CKPT if other == "torch" else GGUF, dtype="auto", num_threads=args.threads, max_context=MAX_LEN)
    target = load_target(cfg, cfg.model, num_slots=1)
    label = f"{other} ({target.info.dtype}, {target.info.threads} threads)"
    return {label: measure(target, slot=0)}


def greedy_identity(target: Target, ids: list[int], runs: list[dict], routes: list[str]) -> dict[str, dict]:
    """Per route at T=0: outputs identical to the baseline's, and the top-2 logit gap at each divergence."""
    out = {}
    for name in routes:
        gaps = []
        for r in runs:
            ref, got = r["baseline"]["output"], r[name]["output"]
            if ref != got:
                pos = next(i for i, (a, b) in enumerate(zip(ref + [-1], got + [-2])) if a != b)
                gaps.append({"prompt": r["prompt"], "position": pos,
                             "logit_gap": logit_gap(target, ids[r["prompt"]] + ref[:pos], ref, got, pos)})
        out[name] = {"identical": len(runs) - len(gaps), "prompts": len(runs), "divergences": gaps}
    return out


def logit_gap(target: Target, context: list[int], ref: list[int], got: list[int], pos: int) -> float:
    """|logit(ref token) - logit(other token)| after `context`, from one plain forward."""
    eos = target.info.eos_token_id
    a, b = (ref + [eos])[pos], (got + [eos])[pos]
    logits, _ = target.prefill(0, context, features=False)
    target.release(0)
    return abs(float(logits[a] - logits[b]))


def report(args, machine: dict, prompts: list, results: dict, identity: dict, curves: dict[str, CostCurve], calibration: str,  # noqa: ANN001
           load_start: tuple, elapsed: float, decisions: list[str]) -> str:
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    lines = [
        f"# bench-engine: speculative algorithms vs the baseline engine ({args.backend} engine)",
        "",
        f"- command: `python -m bench.engine --per-category {args.per_category} --tokens {args.tokens} --temperatures {args.temperatures} "
        f"--backend {args.backend} --repeats {args.repeats}"
        + (f" --algorithms {args.algorithms}" if args.algorithms != ",".join(ALGORITHMS) else "")
        + "`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {elapsed / 60:.1f} min of measurement; "
        f"load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f}",
        *machine_lines(machine),
        f"- sample: {len(prompts)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())}) of bench/prompts.py, "
        f"up to {args.tokens} new tokens "
        f"each (stop at EOS), every route on every prompt {args.repeats} time(s), interleaved; each route's median run per prompt",
        f"- gated: {', '.join(f'{d} {decisions.count(d)}' for d in sorted(set(decisions)))} of {len(decisions)} decisions "
        "(warm-up included)",
        f"- {NO_DRAFTS}: the speculative engine with a drafter that never proposes anything: its loop's own cost over the baseline",
        "",
        "## Verification cost curves (ms per decode of T tokens; ratio to T=1)",
        "",
        "| engine | " + " | ".join(f"T={t}" for t in next(iter(curves.values())).tokens) + " |",
        "|---|" + "---|" * len(next(iter(curves.values())).tokens),
        *(f"| {name} | " + " | ".join(f"{m:.1f} ({m / c.ms[0]:.2f}x)" for m in c.ms) + " |" for name, c in curves.items()),
        "",
        "```",
        calibration,
        "```",
    ]
    for temp, cats in results.items():
        for cat, rows in cats.items():
            peer = next((r["median_tpot_ms"] for r in rows if r["route"] == "peer"), None)
            lines += ["", f"## T={temp}, {cat} ({rows[0]['prompts']} prompts)", "", table(rows, peer)]
    if identity:
        lines += ["", "## T=0 identity with the baseline engine", ""]
        for name, m in identity.items():
            gaps = sorted(g["logit_gap"] for g in m["divergences"])
            lines.append(
                f"- {name}: {m['identical']}/{m['prompts']} identical"
                + (f"; logit gap at each first divergence: {', '.join(f'{x:.3f}' for x in gaps)}" if gaps else "")
            )
    lines += ["", "## Checks", "", *targets(results)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
