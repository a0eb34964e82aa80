"""`make bench-baseline`: plain greedy decoding through every layer, against the peer and the floor.

Paths (same GGUF, threads, prompts and token budget; greedy):
- floor: our engine's bare decode loop (`LlamaCppTarget.forward` + argmax, main thread), a fresh process
- peer: llama-cpp-python's own decoding (`Llama.generate`), a fresh process with nothing of ours in it
- engine: the baseline scheduler (`BatchRunner`) in-process, a fresh process
- triton-stream: `llm` through tritonserver, HTTP generate_stream, speculation off
- triton: the same through HTTP generate (one response per request; end-to-end only)

Each measured process is the only thing computing: this process holds no engine and waits while a
child decodes, and the server is started once and left idle (its CPU use is checked) while the
children run. Every repeat runs every path over every prompt, in a rotated order, so machine noise
spreads over all of them. Reports decode ms per token (first to last token over tokens after the
first; streamed paths only), end-to-end tokens/s and TTFT as median [min-max], and ratios to the
peer and to the floor. The two served paths decode the same tokens one after the other, so they
also give what streaming itself costs: per prompt, the streamed request's time after its first token
over the one-response request's (the streamed TTFT taken off both), and what one streamed response
costs in CPU time in tritonserver and in each Python-backend stub on the way (bench/server_cpu.py),
their difference over the extra responses.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from bench.common import GGUF, ROOT, machine_lines, machine_record, median, running_server, spread, wait_quiet, write_results
from bench.peer import DecodeProcess
from bench.prompts_fixed import DECODE_PROMPTS
from bench.server_cpu import cpu_by_process
from loadtest.metrics import scrape, value, value_or_none
from specgate.contract import ENGINE_RESPONSE_COST_METRIC, ENGINE_STREAM_INTERVAL_METRIC
from specgate.decoding.config import EngineConfig
from specgate.text.tokenizer import PromptTokenizer
from specgate_client import GenerateParams, HttpClient

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
MAX_CONTEXT = 1024
CHILDREN = ("floor", "peer", "engine")
SERVED = ("triton-stream", "triton")
ENGINES = ("target_engine", "spec_engine")
PATHS = CHILDREN + SERVED
# issue 24's streaming target: a response every 20 ms or finer, at no more than 5% of decode speed
FINE_STREAM_MS, STREAM_COST_TARGET = 20.0, 0.05


@dataclass
class Timing:
    """One request: tokens out, TTFT and decode ms per token (None where the path has no token times),
    and for a stream the ms between its responses (first to last over the gaps)."""

    tokens: int
    ttft_ms: float
    e2e_s: float
    decode_ms: float | None
    response_ms: float | None = None
    responses: int = 1

    @property
    def e2e_tps(self) -> float:
        return self.tokens / self.e2e_s


def run_child(proc: DecodeProcess, ids: list[int], n: int, eos: int) -> Timing:
    start = time.perf_counter()
    r = proc.run(ids, n, eos=eos)
    return Timing(len(r.tokens), 1000 * r.ttft_s, time.perf_counter() - start, r.tpot_ms if len(r.tokens) > 1 else None)


def run_triton_stream(client: HttpClient, prompt: str, n: int) -> Timing:
    chunks = list(client.stream(prompt, GenerateParams(max_tokens=n), spec_mode="off"))  # chunk times count from the send
    times = [c.t for c in chunks if c.text]
    tokens = chunks[-1].meta["num_output_tokens"]
    # the engine sends the first token at once and the last as soon as it is made
    decode = 1000 * (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 else None
    every = 1000 * (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return Timing(tokens, 1000 * times[0], chunks[-1].t, decode, every, len(chunks))


def run_triton(client: HttpClient, prompt: str, n: int) -> Timing:
    start = time.perf_counter()
    r = client.generate(prompt, GenerateParams(max_tokens=n), spec_mode="off")
    return Timing(r.meta["num_output_tokens"], float("nan"), time.perf_counter() - start, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: one per core)")
    ap.add_argument("--name", default="bench-baseline", help="results file name (results/<name>.md)")
    ap.add_argument("--ports", default="38000,38001,38002", help="HTTP,gRPC,metrics for the benchmark's own server")
    args = ap.parse_args()
    machine = machine_record()
    load_start = os.getloadavg()
    served = EngineConfig.load(ROOT / "artifacts" / "engines" / "cpu" / "target_engine.json")  # what the server runs
    threads = args.threads or served.threads
    tok = PromptTokenizer(CKPT, MAX_CONTEXT - args.tokens)
    eos = tok.eos_id
    ids = [tok.encode_prompt(p) for p in DECODE_PROMPTS]
    results: dict[str, dict[str, list[float]]] = {k: {"decode_ms": [], "e2e_tps": [], "ttft_ms": [], "response_ms": []} for k in PATHS}
    # the served paths' CPU time by server process, and their responses: what a streamed response costs each hop
    served_cpu: dict[str, Counter[str]] = {m: Counter() for m in SERVED}
    served_responses = Counter[str]()
    stream_cost: list[float] = []  # per prompt and repeat: streaming_cost
    http, grpc, metrics = (int(p) for p in args.ports.split(","))
    with running_server(ROOT / "artifacts" / "model_repository", http, grpc, metrics) as (ports, server_pid):
        client = HttpClient(f"localhost:{ports.http}")
        children = {m: DecodeProcess(m, GGUF, MAX_CONTEXT, threads, exact=served.exact) for m in CHILDREN}  # type: ignore[arg-type]
        paths: dict[str, Callable[[int, int], Timing]] = {
            **{m: (lambda i, n, p=p: run_child(p, ids[i], n, eos)) for m, p in children.items()},
            "triton-stream": lambda i, n: run_triton_stream(client, DECODE_PROMPTS[i], n),
            "triton": lambda i, n: run_triton(client, DECODE_PROMPTS[i], n),
        }
        for fn in paths.values():  # warm-up: first-call allocations, kernel selection, the server's stubs
            fn(0, 8)
        wait_quiet()  # the server's start-up work (spec_engine's calibration) is over
        for r in range(args.repeats):
            order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
            for i in range(len(DECODE_PROMPTS)):
                timed: dict[str, Timing] = {}
                for name in order:
                    before = cpu_by_process(server_pid) if name in SERVED else None
                    t = timed[name] = paths[name](i, args.tokens)
                    if before is not None:
                        served_cpu[name].update(cpu_by_process(server_pid) - before)
                        served_responses[name] += t.responses
                    if t.decode_ms is not None:
                        results[name]["decode_ms"].append(t.decode_ms)
                    results[name]["e2e_tps"].append(t.e2e_tps)
                    if t.ttft_ms == t.ttft_ms:
                        results[name]["ttft_ms"].append(t.ttft_ms)
                    if t.response_ms is not None:
                        results[name]["response_ms"].append(t.response_ms)
                stream_cost.append(streaming_cost(timed["triton-stream"], timed["triton"]))
            print(f"[bench-baseline] repeat {r + 1}/{args.repeats}: "
                  + ", ".join(f"{k} {median(v['decode_ms']):.2f} ms/token" for k, v in results.items() if v["decode_ms"]), flush=True)
        for p in children.values():
            p.close()
        pacing = engine_pacing(ports.metrics)

    hops = response_cpu_ms(served_cpu, served_responses)
    md = report(args, machine, served, threads, results, load_start, pacing, hops, stream_cost)
    print("\n" + md)
    write_results(args.name, md, {"args": vars(args), "machine": machine, "engine": served.model_dump(mode="json"), "pacing": pacing,
                                  "response_cpu_ms": hops, "stream_cost": stream_cost, "results": results})


def streaming_cost(stream: Timing, one: Timing) -> float:
    """What streaming cost one prompt's decode: the streamed request's time after its first token over
    the one-response request's, the streamed TTFT taken off both (the same prefill; the one-response
    request has no first token to time). Both decode the same tokens through the same server."""
    first = stream.ttft_ms / 1000
    return (stream.e2e_s - first) / (one.e2e_s - first)


def engine_pacing(metrics_port: int) -> dict[str, float | None]:
    """target_engine's streaming interval and measured response cost (ms) as it exports them at the end."""
    samples = scrape(metrics_port)
    cost = value_or_none(samples, ENGINE_RESPONSE_COST_METRIC, model="target_engine")
    return {
        "interval_ms": 1000 * value(samples, ENGINE_STREAM_INTERVAL_METRIC, model="target_engine"),
        "response_cost_ms": None if cost is None else 1000 * cost,
    }


def response_cpu_ms(cpu: dict[str, Counter[str]], responses: Counter[str]) -> dict[str, float]:
    """CPU ms one streamed response costs each server process (the engines' left out: server_cpu
    says why): the streamed path's CPU less the one-response path's, over the same prompts and tokens,
    per extra response."""
    extra = responses["triton-stream"] - responses["triton"]
    if extra <= 0:
        return {}
    stream, one = cpu["triton-stream"], cpu["triton"]
    return {k: 1000 * (stream[k] - one[k]) / extra for k in sorted(stream) if k not in ENGINES}


def report(args: argparse.Namespace, machine: dict, served: EngineConfig, threads: int, results: dict, load_start: tuple, pacing: dict,
           hops: dict[str, float], stream_cost: list[float]) -> str:
    floor, peer = median(results["floor"]["decode_ms"]), median(results["peer"]["decode_ms"])
    peer_e2e = median(results["peer"]["e2e_tps"])
    md = [
        f"# bench-baseline (greedy, up to {args.tokens} new tokens, {len(DECODE_PROMPTS)} prompts x {args.repeats} repeats)",
        "",
        f"- command: `{' '.join(['python -m bench.baseline', *sys.argv[1:]])}` "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f})",
        *machine_lines(machine),
        f"- engine: llama.cpp over {GGUF.name}, {threads} threads everywhere; served with exact={served.exact}; "
        "floor and engine use the served exact mode",
        f"- streaming: {streaming_line(served, pacing)}",
        "- floor, peer and engine each ran in a fresh process of their own while the idle server waited",
        "",
        "| path | decode ms/token | vs floor | peer / path (speed vs peer) | end-to-end tok/s | end-to-end vs peer | TTFT ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in results.items():
        dec = median(v["decode_ms"]) if v["decode_ms"] else None
        md.append(
            f"| {name} | {spread(v['decode_ms']) if dec else '-'} | {f'{dec / floor:.2f}x' if dec else '-'} | "
            f"{f'{peer / dec:.2f}' if dec else '-'} | "
            f"{spread(v['e2e_tps'])} | {median(v['e2e_tps']) / peer_e2e:.2f} | {spread(v['ttft_ms'])} |"
        )
    streamed = median(results["triton-stream"]["decode_ms"])
    cost, every = median(stream_cost), median(results["triton-stream"]["response_ms"])
    fine = every <= FINE_STREAM_MS and cost <= 1 + STREAM_COST_TARGET
    md += [
        "",
        f"- baseline through Triton, one request (streamed decode speed): {peer / streamed:.2f}x the peer's (target >= 0.90): "
        f"**{'MET' if peer / streamed >= 0.9 else 'MISSED'}**",
        f"- streaming: a response every {spread(results['triton-stream']['response_ms'])} ms; "
        f"the streamed request took {spread(stream_cost, '.2f')}x "
        f"the one-response request's time after the first token, per prompt (target: every {FINE_STREAM_MS:g} ms or finer at <= "
        f"{1 + STREAM_COST_TARGET:.2f}x): **{'MET' if fine else 'MISSED'}**; its decode was "
        f"{streamed / median(results['engine']['decode_ms']):.2f}x the in-process engine's (another process, another moment)",
        "- CPU time of one streamed response outside the engine (streamed less one-response requests, per extra response): "
        f"{hops_line(hops)}",
    ]
    return "\n".join(md)


def hops_line(hops: dict[str, float]) -> str:
    if not hops:
        return "n/a (the streams sent no more responses than the one-response requests)"
    parts = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(hops.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.005)
    return f"{parts}; {sum(hops.values()):.2f} ms in all"


def streaming_line(served: EngineConfig, pacing: dict) -> str:
    if served.stream_interval_ms is not None:
        return f"a fixed interval of {served.stream_interval_ms:g} ms (build_engines --stream-interval-ms)"
    cost = pacing["response_cost_ms"]
    measured = "no response cost measured yet" if cost is None else f"a response measured to cost {cost:.2f} ms of decode time"
    return (f"measured by the engine within {100 * served.stream_cost_budget:g}% of its decode time; at the end target_engine "
            f"streamed every {pacing['interval_ms']:.1f} ms at most ({measured})")


if __name__ == "__main__":
    main()
