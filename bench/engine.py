"""`make bench-engine`: every speculative algorithm against the baseline engine, in one run, in bf16.

For each temperature (0 and 0.7), each prompt category of bench/prompts.py and overall:

    | algorithm | acceptance rate | accepted/step | TPOT ms | speedup | memory overhead MB |

- baseline: the baseline engine (BatchRunner, one request at a time); the others: the speculative
  generator with each drafter at its serving default (k, EAGLE-2 tree).
- Runs are interleaved per prompt (baseline and every algorithm, in an order rotated per prompt), so
  machine noise hits all alike. Generation stops at EOS or after --tokens new tokens.
- acceptance rate = accepted / draft tokens; accepted/step = 1 + accepted / drafts (tokens per target
  forward); both pooled over the prompts of the row.
- TPOT = (end - first token) / (tokens - 1) per request; speedup = baseline TPOT / algorithm TPOT per
  prompt (paired); both reported as median [min-max] over the row's prompts.
- memory overhead = summed bytes of the tensors the drafter holds (weights, buffers, its own KV
  cache, rotary tables), not counting tensors it shares with the target. Measured on the built
  objects, not estimated from shapes.
- bf16 greedy match rate (T=0): how many outputs equal the baseline's token for token; at each
  first divergence, the two tokens' logit gap in bf16 steps (0-1 steps: an argmax tie that a
  different batch shape can flip).

    python -m bench.engine --per-category 6 --tokens 64
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from bench.common import ROOT, median, spread, write_results
from bench.prompts import CATEGORIES, load_prompts
from specgate.contract import EAGLE_HEAD_ALGORITHMS
from specgate.engine.config import EngineConfig
from specgate.engine.model import KVCache, Llama, load_llama
from specgate.engine.request import Event, GenerationRequest
from specgate.engine.runner import BatchRunner
from specgate.engine.sampling import SamplingParams
from specgate.speculative import SpecStats, SpeculativeGenerator
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import load_eagle_head
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter
from specgate.text.tokenizer import PromptTokenizer

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
DRAFT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-draft"
HEAD = ROOT / "heads" / "smollm2-135m-eagle"
MAX_LEN = 1024  # prompts are capped at ~600 tokens; room for the output and a draft tree
DTYPE = torch.bfloat16
ALGORITHMS = ("draft_model", "ngram", "eagle", "eagle2", "hybrid")


@dataclass
class Run:
    """One request: emitted tokens, per-token time, speculative stats and drafting time."""

    tokens: list[int]
    tpot_ms: float
    stats: SpecStats = field(default_factory=SpecStats)
    draft_s: float = 0.0


# -- running one request -----------------------------------------------------------------------
def run_baseline(runner: BatchRunner, ids: list[int], n: int, params: SamplingParams, eos: int) -> Run:
    times: list[float] = []
    tokens: list[int] = []
    done = threading.Event()

    def emit(ev: Event) -> None:
        if ev.tokens:
            tokens.extend(ev.tokens)
            times.append(time.perf_counter())
        if ev.finished:
            times.append(time.perf_counter())
            done.set()

    runner.submit(GenerationRequest(input_ids=ids, max_new_tokens=n, end_id=eos, sampling=params), emit)
    done.wait()
    return Run(tokens, _tpot_ms(times[0], times[-1], len(tokens)))


class _TimedDrafter:
    """Adds up the time a drafter spends in `propose` (its drafting cost), nothing else changes."""

    def __init__(self, drafter: Drafter) -> None:
        self.seconds = 0.0
        inner = drafter.propose

        def propose(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        drafter.propose = propose  # type: ignore[method-assign]


def run_spec(gen: SpeculativeGenerator, timer: _TimedDrafter, algorithm: str, ids: list[int], n: int, params: SamplingParams) -> Run:
    timer.seconds = 0.0
    stream = gen.generate(ids, n, params, algorithm=algorithm)
    tokens: list[int] = []
    first = 0.0
    for block in stream:
        first = first or time.perf_counter()
        tokens += block
    return Run(tokens, _tpot_ms(first, time.perf_counter(), len(tokens)), stream.stats, timer.seconds)


def _tpot_ms(first: float, end: float, n: int) -> float:
    return 1000 * (end - first) / (n - 1) if n > 1 else float("nan")


# -- memory ------------------------------------------------------------------------------------
def _storages(obj: object, seen: set[int] | None = None) -> dict[int, int]:
    """data_ptr -> nbytes of every tensor storage reachable from `obj` (modules, caches, attributes)."""
    seen = set() if seen is None else seen
    found: dict[int, int] = {}
    if id(obj) in seen:
        return found
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        s = obj.untyped_storage()
        found[s.data_ptr()] = s.nbytes()
        return found
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, (nn.Module, KVCache, Drafter)) or hasattr(obj, "__dict__") and type(obj).__module__.startswith("specgate"):
        children = list(vars(obj).values())
    else:
        return found
    for child in children:
        found.update(_storages(child, seen))
    return found


def overhead_mb(drafter: Drafter, target: Llama) -> float:
    shared = _storages(target)
    own = {p: n for p, n in _storages(drafter).items() if p not in shared}
    return sum(own.values()) / 2**20


# -- the benchmark -----------------------------------------------------------------------------
def build_drafters(target: Llama, algorithms: list[str], head: Path) -> tuple[dict[str, Drafter], list[str]]:
    """Each requested drafter at its serving defaults; notes on the ones that cannot be built."""
    drafters: dict[str, Drafter] = {}
    notes: list[str] = []
    if "ngram" in algorithms:
        drafters["ngram"] = NgramDrafter()
    if "draft_model" in algorithms:
        drafters["draft_model"] = DraftModelDrafter(load_llama(DRAFT, DTYPE, MAX_LEN), target, MAX_LEN)
    if set(EAGLE_HEAD_ALGORITHMS) & set(algorithms):
        if (head / "config.json").exists():
            # One head per drafter, as an engine serving only that algorithm would hold it.
            if "eagle" in algorithms:
                drafters["eagle"] = EagleDrafter(load_eagle_head(head, target, DTYPE), target, MAX_LEN)
            if "eagle2" in algorithms:
                drafters["eagle2"] = Eagle2Drafter(load_eagle_head(head, target, DTYPE), target, MAX_LEN)
            if "hybrid" in algorithms:
                tree = Eagle2Drafter(load_eagle_head(head, target, DTYPE), target, MAX_LEN)
                drafters["hybrid"] = HybridDrafter(tree, NgramDrafter())
        else:
            notes.append(f"{' / '.join(EAGLE_HEAD_ALGORITHMS)} not measured: no EAGLE head at {head} (`make train-eagle` writes it)")
    return drafters, notes


def first_divergence_gap(target: Llama, ids: list[int], ref: list[int], out: list[int]) -> tuple[int, float]:
    """(first position where `out` leaves `ref`, the two tokens' logit gap there in bf16 steps).

    The logits come from one forward over prompt + common prefix; a bf16 step is the spacing of bf16
    numbers at the top logit's magnitude (8 significant bits), so a gap of 0-1 steps is a tie that
    rounding in another batch shape can flip.
    """
    pos = next(i for i, (a, b) in enumerate(zip(ref + [-1], out + [-2])) if a != b)
    eos = target.cfg.eos_token_id
    mine, theirs = (ref + [eos])[pos], (out + [eos])[pos]
    cache = KVCache(target.cfg, 1, MAX_LEN, DTYPE)
    hidden = target(torch.tensor([ids + ref[:pos]]), cache, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    logits = target.logits(hidden[0, -1])
    step = 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)
    return pos, abs(float(logits[mine] - logits[theirs])) / step


def summarize(runs: dict[str, list[tuple[Run, Run]]], memory: dict[str, float]) -> list[dict]:
    """One row per algorithm from its (baseline run, algorithm run) pairs."""
    rows = []
    for name, pairs in runs.items():
        # a one-token output has no TPOT (nan): left out of the medians
        tpot = [r.tpot_ms for _, r in pairs if not math.isnan(r.tpot_ms)]
        speed = [b.tpot_ms / r.tpot_ms for b, r in pairs if not (math.isnan(b.tpot_ms) or math.isnan(r.tpot_ms))]
        drafts = sum(r.stats.num_drafts for _, r in pairs)
        draft_tokens = sum(r.stats.draft_tokens for _, r in pairs)
        accepted = sum(r.stats.accepted_tokens for _, r in pairs)
        rows.append(
            {
                "algorithm": name,
                "prompts": len(pairs),
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "accepted_per_step": 1 + accepted / drafts if drafts else 1.0,  # as SpecStats.mean_acceptance_length
                "tpot_ms": tpot,
                "speedup": speed,
                "median_tpot_ms": median(tpot),
                "median_speedup": median(speed),
                "draft_ms_per_step": 1000 * sum(r.draft_s for _, r in pairs) / drafts if drafts else None,
                "memory_overhead_mb": memory[name],
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| algorithm | acceptance rate | accepted/step | TPOT ms | speedup | memory overhead MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {f(r['acceptance_rate'], '.2f')} | {f(r['accepted_per_step'], '.2f')} | "
            f"{spread(r['tpot_ms'])} | {_ratio(r['speedup']) if r['algorithm'] != 'baseline' else '1.00'} | "
            f"{r['memory_overhead_mb']:.1f} |"
        )
    return "\n".join(lines)


def _ratio(xs: list[float]) -> str:
    """`spread` with two decimals: a speedup of 0.96 must not read as 1.0."""
    return f"{median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "n/a"


def _pct_range(xs: list[float]) -> str:
    lo, hi = f"{min(xs):.0%}", f"{max(xs):.0%}"
    return lo if lo == hi else f"{lo}-{hi}"


def targets(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The issue's targets, each with whether this run meets it (greedy, T=0 rows)."""

    def row(temp: str, cat: str, algo: str) -> dict | None:
        return next((r for r in results[temp][cat] if r["algorithm"] == algo), None)

    def check(label: str, ok: bool | None, detail: str) -> str:
        verdict = "not measured" if ok is None else ("MET" if ok else "MISSED")
        return f"- {label}: **{verdict}** ({detail})"

    t0 = next(iter(results))
    out = []
    e2 = row(t0, "overall", "eagle2")
    out.append(
        check(
            "eagle2 >= 3.0x overall with >= 4.0 accepted/step",
            None if e2 is None else e2["median_speedup"] >= 3.0 and (e2["accepted_per_step"] or 0) >= 4.0,
            "no head" if e2 is None else f"{e2['median_speedup']:.2f}x, {e2['accepted_per_step']:.2f} accepted/step",
        )
    )
    e1 = row(t0, "overall", "eagle")
    out.append(check("eagle >= 2.5x", None if e1 is None else e1["median_speedup"] >= 2.5, "no head" if e1 is None else f"{e1['median_speedup']:.2f}x"))
    ng = [row(t0, c, "ngram") for c in ("summarization", "code")]
    out.append(
        check(
            "ngram > 1.5x on summarization and code",
            None if None in ng else all(r["median_speedup"] > 1.5 for r in ng),  # type: ignore[index]
            ", ".join(f"{c} {r['median_speedup']:.2f}x" for c, r in zip(("summarization", "code"), ng) if r),
        )
    )
    slow: dict[str, list[tuple[str, dict, dict]]] = {}  # algorithm -> (where, row, baseline row)
    for temp, cats in results.items():
        for cat, rows in cats.items():
            for r in rows[1:]:
                if r["median_speedup"] < 1.0:
                    slow.setdefault(r["algorithm"], []).append((f"{cat} T={temp} {r['median_speedup']:.2f}x", r, rows[0]))
    out.append(check("no algorithm slower than baseline on any category", not slow, f"slower: {', '.join(slow)}" if slow else "none slower"))
    for algo, cases in slow.items():
        gain = [r["accepted_per_step"] - 1 for _, r, _ in cases]
        cost = [(r["draft_ms_per_step"] or 0.0) / b["median_tpot_ms"] for _, r, b in cases]
        out.append(
            f"  - {algo} ({'; '.join(w for w, _, _ in cases)}): each target forward yields only "
            f"{_pct_range(gain)} more tokens, while drafting costs {_pct_range(cost)} of a baseline step "
            "and verifying the drafted tokens lengthens the target forward: cost exceeds gain"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6, help="prompts per category (of 200)")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per request")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--eagle-head", type=Path, default=HEAD, help="directory with eagle_head.safetensors + config.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    algorithms = args.algorithms.split(",")
    temps = [float(t) for t in args.temperatures.split(",")]
    load_start = os.getloadavg()

    tok = PromptTokenizer(CKPT, MAX_LEN - args.tokens - 70)  # room for the output and an EAGLE-2 tree
    prompts = load_prompts(limit_per_category=args.per_category)
    ids = [tok.encode_prompt(p.text) for p in prompts]
    target = load_llama(CKPT, DTYPE, MAX_LEN)
    runner = BatchRunner(target, EngineConfig(checkpoint_dir=CKPT, max_context=MAX_LEN, max_batch_size=1))
    drafters, notes = build_drafters(target, algorithms, args.eagle_head)
    memory = {"baseline": 0.0} | {name: overhead_mb(d, target) for name, d in drafters.items()}
    timers = {name: _TimedDrafter(d) for name, d in drafters.items()}
    gen = SpeculativeGenerator(target, drafters, MAX_LEN)
    eos = target.cfg.eos_token_id
    names = ["baseline", *drafters]

    def one(name: str, i: int, params: SamplingParams) -> Run:
        if name == "baseline":
            return run_baseline(runner, ids[i], args.tokens, params, eos)
        return run_spec(gen, timers[name], name, ids[i], args.tokens, params)

    for name in names:  # warm-up: first-call allocations and kernel selection
        one(name, 0, SamplingParams())

    results: dict[str, dict[str, list[dict]]] = {}
    raw_runs: dict[str, list[dict]] = {}
    match: dict[str, dict] = {}
    t_start = time.perf_counter()
    for temp in temps:
        per: dict[str, dict[str, list[tuple[Run, Run]]]] = {c: {n: [] for n in names} for c in CATEGORIES}
        raw_runs[str(temp)] = []
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=temp, seed=i)
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate: no fixed position in the sequence
            got: dict[str, Run] = {n: one(n, i, params) for n in order}
            for n in names:
                per[p.category][n].append((got["baseline"], got[n]))
            raw_runs[str(temp)].append({"category": p.category, "prompt": i, "prompt_tokens": len(ids[i])} | {
                n: {"tokens": len(r.tokens), "tpot_ms": r.tpot_ms, "drafts": r.stats.num_drafts, "accepted": r.stats.accepted_tokens,
                    "draft_tokens": r.stats.draft_tokens, "output": r.tokens} for n, r in got.items()})
            print(f"[T={temp}] {i + 1}/{len(prompts)} {p.category}: " + ", ".join(f"{n} {r.tpot_ms:.1f}ms" for n, r in got.items()), flush=True)
        cats = {c: summarize(per[c], memory) for c in CATEGORIES}
        overall = {n: [pair for c in CATEGORIES for pair in per[c][n]] for n in names}
        cats["overall"] = summarize(overall, memory)
        results[str(temp)] = cats
        if temp == 0.0:
            match = greedy_match(target, ids, raw_runs[str(temp)], list(drafters))
    elapsed = time.perf_counter() - t_start

    md = report(args, prompts, results, match, notes, load_start, elapsed)
    print("\n" + md)
    write_results("bench-engine", md, {"args": vars(args) | {"eagle_head": str(args.eagle_head)}, "results": results, "greedy_match": match, "notes": notes, "runs": raw_runs})


def greedy_match(target: Llama, ids: list[int], runs: list[dict], algorithms: list[str]) -> dict[str, dict]:
    """Per algorithm at T=0: identical outputs vs the baseline, and the top-2 gap at each divergence."""
    out = {}
    for name in algorithms:
        gaps = []
        for r in runs:
            ref, got = r["baseline"]["output"], r[name]["output"]
            if ref != got:
                pos, steps = first_divergence_gap(target, ids[r["prompt"]], ref, got)
                gaps.append({"prompt": r["prompt"], "position": pos, "gap_bf16_steps": steps})
        out[name] = {"identical": len(runs) - len(gaps), "prompts": len(runs), "divergences": gaps}
    return out


def report(args: argparse.Namespace, prompts: list, results: dict, match: dict, notes: list[str], load_start: tuple, elapsed: float) -> str:
    counts = {c: sum(p.category == c for p in prompts) for c in CATEGORIES}
    lines = [
        "# bench-engine: speculative algorithms vs the baseline engine (CPU reference engine, bf16)",
        "",
        f"- command: `python -m bench.engine --per-category {args.per_category} --tokens {args.tokens} "
        f"--temperatures {args.temperatures} --threads {args.threads}"
        + ("" if args.eagle_head == HEAD else f" --eagle-head {args.eagle_head}")
        + "`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {elapsed / 60:.1f} min of measurement",
        f"- machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{args.threads} torch thread(s); load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f}",
        f"- sample: {len(prompts)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())}) of bench/prompts.py, "
        f"up to {args.tokens} new tokens each (stop at EOS), every algorithm on every prompt, interleaved",
        "- acceptance rate and accepted/step pooled over the row's prompts; TPOT and speedup (paired, per prompt): "
        "median [min-max]; memory: summed bytes of the drafter's own tensors (weights, buffers, KV cache)",
        *[f"- {n}" for n in notes],
    ]
    for temp, cats in results.items():
        for cat, rows in cats.items():
            lines += ["", f"## T={temp}, {cat} ({rows[0]['prompts']} prompts)", "", table(rows)]
    if match:
        lines += ["", "## bf16 greedy match rate vs baseline (T=0)", ""]
        lines.append("Identical outputs (token for token, up to --tokens) and, at each first divergence, the logit gap between the two tokens in bf16 steps at that logit's magnitude:")
        lines.append("")
        for name, m in match.items():
            steps = sorted(g["gap_bf16_steps"] for g in m["divergences"])
            lines.append(
                f"- {name}: {m['identical']}/{m['prompts']} identical ({m['identical'] / m['prompts']:.0%})"
                + (f"; gaps at the {len(steps)} divergences: {', '.join(f'{x:.1f}' for x in steps)}" if steps else "")
            )
    lines += ["", "## Targets (T=0)", "", *targets(results)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
