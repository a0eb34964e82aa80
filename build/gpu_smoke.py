"""`make gpu-smoke`: build the TensorRT-LLM engines for a small model, serve them, check both routes.

Run inside the NGC image (docs/trtllm.md). Steps:
  1. build the engines from a spec and render the tensorrtllm repository (skipped steps resume);
  2. start tritonserver in the backend's orchestrator mode (build/trtllm/serve.py);
  3. greedy requests: (a) straight to target_engine and spec_engine over gRPC, same prompt ids ->
     the token ids must be identical; (b) through `llm` over HTTP generate with the body field
     "x-speculative-decoding": "off" and "prod" -> same text, routes baseline / speculative, and the
     same text again over generate_stream;
  4. read the gate's metrics from the metrics port (drafted / accepted tokens, decisions).
Exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

from build.trtllm.build import ROOT, add_arguments, build
from build.trtllm.serve import server_command, server_env
from build.trtllm.spec import BuildSpec, load_spec
from loadtest.metrics import gate_deltas, scrape
from specgate.contract import engine_inputs
from specgate.secret_file import ensure_secret
from specgate_client import stream_engine
from specgate_launcher import ENGINE_SECRET, Ports, stop, wait_ready

PROMPTS = ["Write a haiku about the sea.", "List three uses of a paperclip."]


def engine_tokens(url: str, model: str, ids: list[int], max_tokens: int, end_id: int) -> tuple[list[int], int, int]:
    """One greedy request to a (decoupled) engine over gRPC: (output ids, draft tokens, accepted)."""
    arrays = engine_inputs(ids, max_tokens, end_id, top_k=1, streaming=False)  # top_k=1: greedy
    names = ["output_ids", "total_draft_tokens", "total_accepted_draft_tokens"]
    out: list[int] = []
    drafted = accepted = 0
    for _, result in stream_engine(url, model, arrays, outputs=names, timeout_s=300):
        ids_out = result.as_numpy("output_ids")
        if ids_out is not None:
            out += [int(t) for t in ids_out.reshape(-1)]
            drafted = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
            accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    return out, drafted, accepted


def prompt_ids(http: str, prompt: str) -> list[int]:
    """Tokenize with the served preprocessing model, so both engines see exactly what the gate sends."""
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]}], "outputs": [{"name": "input_ids"}]}
    with urllib.request.urlopen(_post(f"http://{http}/v2/models/preprocessing/infer", body), timeout=60) as r:
        return [int(t) for t in json.loads(r.read())["outputs"][0]["data"]]


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})


def _text(v: object) -> str:
    """Triton's generate JSON gives a one-element tensor as a scalar, a longer one as a list."""
    return "".join(map(str, v)) if isinstance(v, list) else str(v)


def generate(http: str, prompt: str, max_tokens: int, spec_mode: str) -> dict[str, str]:
    """HTTP generate on `llm`; the header travels as a body field (2.51 forwards no generate headers)."""
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0, "x-speculative-decoding": spec_mode}
    with urllib.request.urlopen(_post(f"http://{http}/v2/models/llm/generate", body), timeout=300) as r:
        out = json.loads(r.read())
    return {k: _text(out.get(k, "")) for k in ("text_output", "route", "gate_reason")}


def generate_stream_text(http: str, prompt: str, max_tokens: int, spec_mode: str) -> tuple[str, int]:
    """HTTP generate_stream (SSE) on `llm`: (concatenated text_output, number of events)."""
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "x-speculative-decoding": spec_mode}
    text, events = "", 0
    with urllib.request.urlopen(_post(f"http://{http}/v2/models/llm/generate_stream", body), timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise RuntimeError(f"generate_stream: {event['error']}")
                text += _text(event.get("text_output", ""))
                events += 1
    return text, events


def check(ok: bool, what: str, failures: list[str]) -> None:
    print(f"[gpu-smoke] {'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def smoke(spec: BuildSpec, ports: Ports, max_tokens: int, failures: list[str]) -> None:
    http, grpc = f"localhost:{ports.http}", f"localhost:{ports.grpc}"
    expect_drafts = spec.speculative.method != "draft_model"  # no orchestrator feeds draft_input_ids
    for prompt in PROMPTS:
        ids = prompt_ids(http, prompt)
        base, _, _ = engine_tokens(grpc, "target_engine", ids, max_tokens, spec.end_id)
        spec_out, drafted, accepted = engine_tokens(grpc, "spec_engine", ids, max_tokens, spec.end_id)
        same = next((i for i, (a, b) in enumerate(zip(base, spec_out)) if a != b), min(len(base), len(spec_out)))
        check(base == spec_out, f"engines token-identical for {prompt!r} ({len(base)} tokens; first difference at {same})", failures)
        check(drafted > 0 or not expect_drafts, f"spec_engine drafted {drafted} tokens, accepted {accepted}", failures)
        off = generate(http, prompt, max_tokens, "off")
        prod = generate(http, prompt, max_tokens, "prod")
        check(off.get("route") == "baseline", f"x-speculative-decoding=off -> route {off.get('route')!r}", failures)
        check(prod.get("route") == "speculative", f"x-speculative-decoding=prod -> route {prod.get('route')!r} ({prod.get('gate_reason')})",
              failures)
        check(off["text_output"] == prod["text_output"], f"llm text identical across routes ({len(off['text_output'])} chars)", failures)
        streamed, events = generate_stream_text(http, prompt, max_tokens, "prod")  # decoupled engine, streamed
        check(streamed == prod["text_output"], f"generate_stream text equals generate text ({events} events)", failures)
    counters = gate_deltas({}, scrape(ports.metrics))  # a fresh server: totals since start
    print(f"[gpu-smoke] gate metrics: {counters}", flush=True)
    speculative = sum(n for key, n in counters["decisions"].items() if key.startswith("speculative,"))
    check(speculative > 0, "spec_gate_decisions_total{route=\"speculative\"} > 0", failures)
    check(counters["totals"]["num_draft_tokens"] > 0 or not expect_drafts, "spec_decode_num_draft_tokens_total > 0", failures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # lookahead needs no extra weights, so the default smoke runs on a fresh machine; pass an EAGLE spec
    # once its head is exported (docs/trtllm.md)
    add_arguments(ap, default_spec=ROOT / "build" / "specs" / "smollm2-ngram.yaml")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    args = ap.parse_args()

    spec = load_spec(args.spec, ROOT)
    out = (args.artifacts / "gpu-smoke").resolve()
    build(spec, args.artifacts, out, ROOT / "policy" / "default.yaml", args.trtllm_examples, args.trtllm_python, args.dry_run)
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    cmd = server_command(out / "model_repository", ports, spec.parallel)
    env = server_env(ROOT)
    ensure_secret(ENGINE_SECRET)
    print("[gpu-smoke] server: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return
    out.mkdir(parents=True, exist_ok=True)
    log = out / "tritonserver.log"
    print(f"[gpu-smoke] log: {log}", flush=True)
    with open(log, "w") as log_f:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    failures: list[str] = []
    try:
        wait_ready(proc, ports, timeout_s=900)
        smoke(spec, ports, args.max_tokens, failures)
    finally:
        stop(proc)
    if failures:
        print(f"[gpu-smoke] {len(failures)} check(s) failed (server log: {log})", file=sys.stderr)
        sys.exit(1)
    print("[gpu-smoke] all checks passed", flush=True)


if __name__ == "__main__":
    main()
