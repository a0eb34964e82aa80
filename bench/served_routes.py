"""`python -m bench.served_routes`: per prompt category, through Triton, the default route against
speculation off and against a clean llama-cpp-python process (issue 47's moonshot).

Paths (same GGUF, threads, prompts and token budget; greedy):
- peer: llama-cpp-python's own decoding (`Llama.generate`) in a fresh process of its own;
- off: `llm` through tritonserver, HTTP generate_stream, `x-speculative-decoding: off`;
- default: the same with no header, as a user's application sends it: the shipped policy and the
  gate decide (route, algorithm), spec_engine drafts what pays;
- prod (`--routes peer,off,default,prod`): speculation asked for. Like any request that asks for
  the route, its results feed the tenant's evidence, which the default route's decisions then
  read, so it is not run unless asked for.

One server, started for the run and left idle while the peer decodes; every prompt runs every path
in an order rotated per prompt, so the machine's drift hits all alike; with --repeats N each path
keeps its median per prompt. Decode ms per token is (last - first token) / (tokens - 1) from the
stream's event times (the engines send the first token at once and the last as soon as it is made).
Speedups are paired per prompt, median [min-max] over a category's prompts and over all of them.
T=0 identity: each route's text equal to `off`'s, per prompt.

    python -m bench.served_routes --per-category 4 --tokens 96
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections import Counter
from dataclasses import dataclass

from bench.baseline import CKPT, GGUF, MAX_CONTEXT
from bench.common import ROOT, machine_lines, machine_record, median_run, running_server, spread, tpot_ms, wait_quiet, write_results
from bench.peer import DecodeProcess
from bench.prompts import CATEGORIES, load_prompts
from specgate.decoding.config import EngineConfig
from specgate.text.tokenizer import PromptTokenizer
from specgate_client import GenerateParams, HttpClient

SERVED_MODES = {"off": "off", "default": None, "prod": "prod"}  # route -> x-speculative-decoding
# issue 47's bars for the default route against the peer, per category ("overall": every prompt)
BARS = {"summarization": 1.3, "code": 1.15, "overall": 1.1}


@dataclass
class Run:
    text: str
    tpot_ms: float
    route: str = ""
    reason: str = ""
    drafted: int = 0
    accepted: int = 0


def served(client: HttpClient, prompt: str, tokens: int, mode: str | None) -> Run:
    chunks = list(client.stream(prompt, GenerateParams(max_tokens=tokens), spec_mode=mode))
    times = [c.t for c in chunks if c.text]
    n, meta = chunks[-1].meta["num_output_tokens"], chunks[-1].meta
    return Run("".join(c.text for c in chunks), tpot_ms(times, n), str(meta.get("route")), str(meta.get("gate_reason")),
               int(meta.get("num_draft_tokens") or 0), int(meta.get("num_accepted_tokens") or 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--routes", default="peer,off,default", help="of peer, off, default, prod")
    ap.add_argument("--name", default="bench-served-routes")
    ap.add_argument("--ports", default="38000,38001,38002", help="HTTP,gRPC,metrics for the benchmark's own server")
    args = ap.parse_args()
    routes = args.routes.split(",")
    if "off" not in routes or not set(routes) <= {"peer", *SERVED_MODES}:
        ap.error("--routes: a subset of peer,off,default,prod that holds off (the reference)")
    record = machine_record()
    print("\n".join(machine_lines(record)), flush=True)
    engine = EngineConfig.load(ROOT / "artifacts" / "engines" / "cpu" / "target_engine.json")
    tok = PromptTokenizer(CKPT, MAX_CONTEXT - args.tokens)
    prompts = [p for c in CATEGORIES for p in load_prompts(c, args.per_category)]
    ids = [tok.encode_prompt(p.text) for p in prompts]
    runs: dict[str, list[list[Run]]] = {r: [[] for _ in prompts] for r in routes}
    http, grpc, metrics = (int(p) for p in args.ports.split(","))
    with running_server(ROOT / "artifacts" / "model_repository", http, grpc, metrics) as (ports, _):
        client = HttpClient(f"localhost:{ports.http}")
        peer = DecodeProcess("peer", GGUF, MAX_CONTEXT, engine.threads, exact=engine.exact) if "peer" in routes else None

        def run(route: str, i: int, tokens: int) -> Run:
            if route == "peer":
                assert peer is not None
                r = peer.run(ids[i], tokens, eos=tok.eos_id)
                return Run("", r.tpot_ms)  # its tokens are not compared: the served routes' are, with off
            return served(client, prompts[i].text, tokens, SERVED_MODES[route])

        for route in routes:  # warm-up: first-call allocations, the server's stubs
            run(route, 0, 8)
        wait_quiet()
        for rep in range(args.repeats):
            for i in range(len(prompts)):
                k = (i + rep) % len(routes)
                for route in routes[k:] + routes[:k]:
                    runs[route][i].append(run(route, i, args.tokens))
                print(f"[bench] repeat {rep + 1} prompt {i + 1}/{len(prompts)} ({prompts[i].category}): "
                      + ", ".join(f"{r} {runs[r][i][-1].tpot_ms:.2f} ms" for r in routes), flush=True)
        if peer is not None:
            peer.close()
    md, raw = report(args, record, prompts, ids, runs)
    print("\n" + md)
    write_results(args.name, md, raw)


def report(
    args: argparse.Namespace, record: dict, prompts: list, ids: list[list[int]], runs: dict[str, list[list[Run]]]
) -> tuple[str, dict]:
    routes = list(runs)
    best = {r: [median_run(rs) for rs in runs[r]] for r in routes}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Routes through Triton per category ({now})",
        "",
        f"`python -m bench.served_routes --per-category {args.per_category} --tokens {args.tokens} --repeats {args.repeats} "
        f"--routes {args.routes}`: T=0, one server; speedup = the reference's decode ms per token over the route's, "
        "paired per prompt, median [min-max].",
        *machine_lines(record),
        "",
    ]
    refs = [r for r in ("peer", "off") if r in routes]
    header = "| category | prompts | prompt tokens | " + " | ".join(f"{r} ms/token" for r in routes)
    header += " | " + " | ".join(f"{r} vs {ref}" for ref in refs for r in routes if r not in (ref, "peer")) + " |"
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    raw_rows = {}
    for cat in (*CATEGORIES, "overall"):
        idx = [i for i, p in enumerate(prompts) if cat in ("overall", p.category)]
        cells = [cat, str(len(idx)), spread([float(len(ids[i])) for i in idx], ".0f")]
        cells += [spread([best[r][i].tpot_ms for i in idx], ".2f") for r in routes]
        row = {}
        for ref in refs:
            for r in routes:
                if r in (ref, "peer"):
                    continue
                ratios = [best[ref][i].tpot_ms / best[r][i].tpot_ms for i in idx]
                row[f"{r}/{ref}"] = ratios
                cells.append(spread(ratios, ".2f"))
        raw_rows[cat] = row
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in routes:
        if r in ("peer", "off"):
            continue
        same = sum(best[r][i].text == best["off"][i].text for i in range(len(prompts)))
        drafted = sum(x.drafted for x in best[r])
        accepted = sum(x.accepted for x in best[r])
        decisions = Counter(f"{x.route} ({x.reason})" for rs in runs[r] for x in rs)
        lines.append(f"- {r}: text identical to off on {same}/{len(prompts)} prompts; {drafted} tokens drafted, "
                     f"{accepted} accepted; the gate's decisions: " + ", ".join(f"{k} {v}" for k, v in decisions.most_common()))
    if "default" in routes and "peer" in routes:
        for cat, bar in BARS.items():
            ratio = statistics.median(raw_rows[cat]["default/peer"])
            lines.append(f"- issue 47: default route vs the peer, {cat}: {ratio:.3f}x (>= {bar}: {'met' if ratio >= bar else 'NOT met'})")
    raw = {"args": vars(args), "machine": record, "rows": raw_rows,
           "runs": {r: [[x.__dict__ for x in rs] for rs in runs[r]] for r in routes},
           "prompts": [{"category": p.category, "tokens": len(ids[i])} for i, p in enumerate(prompts)]}
    return "\n".join(lines) + "\n", raw


if __name__ == "__main__":
    main()
