"""`make bench-front`: what the OpenAI-compatible front costs.

TPOT of a streamed chat request through the front (`/v1/chat/completions`, SSE) against the same
request to `llm` over gRPC streaming, run back to back per prompt, alternating which goes first, on
one server started for the run. Target: the front adds at most 5% (per-pair ratio). Baseline route
by default (one token per response: the most chunks per token, so the front's worst case);
`--mode prod` measures the speculative route.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import replace

import requests

from bench.common import ROOT, machine_lines, machine_record, median, running_server, spread, write_results
from bench.gate import tpot_ms
from bench.prompts_fixed import DECODE_PROMPTS
from specgate_client import GenerateParams, GrpcClient
from specgate_launcher import running_front

Points = list[tuple[float, int]]  # (seconds since the request, tokens so far) per response with text


def direct(client: GrpcClient, prompt: str, n: int, mode: str) -> tuple[Points, str]:
    chunks = list(client.stream(prompt, GenerateParams(max_tokens=n), spec_mode=mode))
    return [(c.t, c.meta["num_output_tokens"]) for c in chunks if c.text], "".join(c.text for c in chunks)


def through_front(session: requests.Session, url: str, prompt: str, n: int, mode: str) -> tuple[Points, str]:
    """Raw SSE over a kept-alive connection, parsed no more than the gRPC client parses its responses."""
    body = {"model": "llm", "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "stream": True}
    t0 = time.perf_counter()
    points, text = [], ""
    with session.post(f"{url}/v1/chat/completions", json=body, headers={"x-speculative-decoding": mode}, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                points.append((time.perf_counter() - t0, chunk["specgate"]["num_output_tokens"]))
                text += delta
    return points, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", choices=("off", "prod"), default="off", help="x-speculative-decoding for both paths")
    ap.add_argument("--http-port", type=int, default=38000,
                    help="the run's server: HTTP, then gRPC, metrics and the front on the next three ports")
    args = ap.parse_args()
    machine = machine_record()
    load_start = os.getloadavg()
    res: dict[str, list[float]] = {"direct": [], "front": []}
    ttft: dict[str, list[float]] = {"direct": [], "front": []}
    same_text = 0
    with running_server(ROOT / "artifacts" / "model_repository", args.http_port, args.http_port + 1, args.http_port + 2) as (ports, _):
        ports = replace(ports, front=args.http_port + 3)
        with running_front(ports, ROOT / "results" / f"bench-front-{ports.front}.log"):
            client, session, url = GrpcClient(f"localhost:{ports.grpc}"), requests.Session(), f"http://127.0.0.1:{ports.front}"
            paths = {
                "direct": lambda p, n: direct(client, p, n, args.mode),
                "front": lambda p, n: through_front(session, url, p, n, args.mode),
            }
            for fn in paths.values():  # warm-up
                fn(DECODE_PROMPTS[0], 8)
            for r in range(args.repeats):
                for i, prompt in enumerate(DECODE_PROMPTS):
                    order = ("direct", "front") if (r + i) % 2 == 0 else ("front", "direct")
                    texts = {}
                    for name in order:
                        points, texts[name] = paths[name](prompt, args.tokens)
                        res[name].append(tpot_ms(points))
                        ttft[name].append(1000 * points[0][0])
                    same_text += texts["direct"] == texts["front"]
                print(f"[bench-front] repeat {r + 1}/{args.repeats}: direct {median(res['direct']):.1f} ms, "
                      f"front {median(res['front']):.1f} ms", flush=True)
    ratio = [f / d for f, d in zip(res["front"], res["direct"])]
    n = len(ratio)
    md = [
        f"# bench-front (x-speculative-decoding: {args.mode}, T=0, up to {args.tokens} tokens, "
        f"{len(DECODE_PROMPTS)} prompts x {args.repeats}, streamed)",
        "",
        f"- command: `python -m bench.front --tokens {args.tokens} --repeats {args.repeats} --mode {args.mode}` "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f})",
        *machine_lines(machine),
        "",
        "| path | TPOT ms | TTFT ms |",
        "|---|---|---|",
        f"| llm over gRPC streaming (tritonclient) | {spread(res['direct'])} | {spread(ttft['direct'])} |",
        f"| front: /v1/chat/completions, SSE | {spread(res['front'])} | {spread(ttft['front'])} |",
        "",
        f"- front / direct TPOT, per pair: median {median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}] (target <= 1.05)",
        f"- same text in {same_text}/{n} pairs",
    ]
    print("\n".join(md))
    write_results("bench-front", "\n".join(md) + "\n",
                  {"args": vars(args), "machine": machine, "tpot_ms": res, "ttft_ms": ttft, "ratio": ratio})


if __name__ == "__main__":
    main()
