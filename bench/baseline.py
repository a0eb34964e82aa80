"""`make bench-baseline`: plain greedy decoding, the peer against our baseline engine, in one run.

- peer: llama-cpp-python's own decoding of the same GGUF with the same threads (bench/peer.py)
- engine: our baseline engine in-process (BatchRunner over the served backend, one request at a time)
- triton-stream: the same engine through tritonserver (`llm`, HTTP generate_stream, speculation off)
- triton: the same through HTTP generate (one response per request)

Runs are interleaved per prompt per repeat, so machine noise hits all alike. Reports decode
tokens/s (after the first token; streaming paths only), end-to-end tokens/s (tokens over the whole
request, prompt included) and TTFT, as median [min-max], and each path's ratio to the peer.
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time

from bench.common import ROOT, machine_lines, machine_record, median, running_server, spread, write_results
from bench.peer import Peer
from bench.prompts_fixed import DECODE_PROMPTS
from specgate_client import GenerateParams, HttpClient
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.request import Event, GenerationRequest
from specgate.decoding.batch_runner import BatchRunner
from specgate.text.tokenizer import PromptTokenizer

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
GGUF = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_CONTEXT = 1024
PATHS = ("peer", "engine", "triton-stream", "triton")


class Timing:
    """One request: tokens, start, first and last token times (perf_counter seconds)."""

    def __init__(self, start: float, times: list[float], tokens: int) -> None:
        self.tokens, self.start, self.first, self.end = tokens, start, times[0], times[-1]
        self.decode_tps = (tokens - 1) / (times[-1] - times[0]) if tokens > 1 and times[-1] > times[0] else None

    @property
    def e2e_tps(self) -> float:
        return self.tokens / (self.end - self.start)


def run_peer(peer: Peer, ids: list[int], n: int, eos: int) -> Timing:
    start = time.perf_counter()
    r = peer.run(ids, n, eos=eos)
    first = start + r.ttft_s
    return Timing(start, [first, first + r.tpot_ms * (len(r.tokens) - 1) / 1000], len(r.tokens))


def run_engine(runner: BatchRunner, ids: list[int], n: int, eos: int) -> Timing:
    times: list[float] = []
    count = [0]
    done = threading.Event()

    def emit(ev: Event) -> None:
        if ev.tokens:
            times.append(time.perf_counter())
            count[0] += len(ev.tokens)
        if ev.finished:
            done.set()

    start = time.perf_counter()
    runner.submit(GenerationRequest(input_ids=ids, max_new_tokens=n, end_id=eos), emit)
    done.wait()
    return Timing(start, times, count[0])


def run_triton_stream(client: HttpClient, prompt: str, n: int) -> Timing:
    chunks = list(client.stream(prompt, GenerateParams(max_tokens=n), spec_mode="off"))  # chunk times count from the send
    return Timing(0.0, [c.t for c in chunks if c.text], chunks[-1].meta["num_output_tokens"])


def run_triton(client: HttpClient, prompt: str, n: int) -> Timing:
    start = time.perf_counter()
    r = client.generate(prompt, GenerateParams(max_tokens=n), spec_mode="off")
    end = time.perf_counter()
    return Timing(start, [end, end], r.meta["num_output_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: one per core)")
    args = ap.parse_args()
    machine = machine_record()
    load_start = os.getloadavg()
    cfg = EngineConfig(model=GGUF, max_context=MAX_CONTEXT, max_batch_size=1, num_threads=args.threads, queue_timeout_s=1e6)
    runner = BatchRunner(load_target(cfg, GGUF, num_slots=1), cfg)
    peer = Peer(GGUF, MAX_CONTEXT, cfg.threads)
    tok = PromptTokenizer(CKPT, MAX_CONTEXT - args.tokens)
    eos = tok.eos_id
    ids = [tok.encode_prompt(p) for p in DECODE_PROMPTS]
    results: dict[str, dict[str, list[float]]] = {k: {"decode_tps": [], "e2e_tps": [], "ttft_ms": []} for k in PATHS}
    with running_server(ROOT / "artifacts" / "model_repository") as ports:
        client = HttpClient(f"localhost:{ports.http}")
        for name, fn in _paths(client, runner, peer, DECODE_PROMPTS[0], ids[0], 8, eos).items():  # warm-up
            fn()
        for r in range(args.repeats):
            for prompt, pid in zip(DECODE_PROMPTS, ids):
                for name, fn in _paths(client, runner, peer, prompt, pid, args.tokens, eos).items():
                    t = fn()
                    if t.decode_tps is not None:
                        results[name]["decode_tps"].append(t.decode_tps)
                    results[name]["e2e_tps"].append(t.e2e_tps)
                    results[name]["ttft_ms"].append(1000 * (t.first - t.start))
            print(f"[bench-baseline] repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {median(v['e2e_tps']):.1f} tok/s" for k, v in results.items()), flush=True)
    runner.shutdown()

    peer_decode, peer_e2e = median(results["peer"]["decode_tps"]), median(results["peer"]["e2e_tps"])
    md = [
        f"# bench-baseline (greedy, up to {args.tokens} new tokens, {len(DECODE_PROMPTS)} prompts x {args.repeats} repeats)",
        "",
        f"- command: `python -m bench.baseline --tokens {args.tokens} --repeats {args.repeats}` "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f})",
        *machine_lines(machine),
        f"- engine: llama.cpp over {GGUF.name}, {cfg.threads} threads (peer and engine alike)",
        "",
        "| path | decode tok/s | end-to-end tok/s | TTFT ms | decode / peer | end-to-end / peer |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in results.items():
        dec = median(v["decode_tps"]) / peer_decode if v["decode_tps"] else None
        md.append(
            f"| {name} | {spread(v['decode_tps'])} | {spread(v['e2e_tps'])} | {spread(v['ttft_ms'])} | "
            f"{'-' if dec is None else f'{dec:.2f}'} | {median(v['e2e_tps']) / peer_e2e:.2f} |"
        )
    stream = median(results["triton-stream"]["decode_tps"]) / peer_decode
    md += ["", f"- baseline through Triton, one request (streamed decode rate): {stream:.2f}x the peer (target >= 0.90): **{'MET' if stream >= 0.9 else 'MISSED'}**"]
    print("\n".join(md))
    write_results("bench-baseline", "\n".join(md) + "\n", {"args": vars(args), "machine": machine, "results": results})


def _paths(client: HttpClient, runner: BatchRunner, peer: Peer, prompt: str, ids: list[int], n: int, eos: int) -> dict:
    return {
        "peer": lambda: run_peer(peer, ids, n, eos),
        "engine": lambda: run_engine(runner, ids, n, eos),
        "triton-stream": lambda: run_triton_stream(client, prompt, n),
        "triton": lambda: run_triton(client, prompt, n),
    }


if __name__ == "__main__":
    main()
