"""`make bench-gate`: what the gate costs.

1. Decision latency: `Gate.decide()` in-process over a mixed workload (target p99 < 100 us).
2. End to end: TPOT through `llm` with the gate routing speculative, against calling `spec_engine`
   directly over gRPC with the same tokens and algorithm, interleaved per prompt (target: the gate
   adds at most 5%).
"""

from __future__ import annotations

import argparse
import time

from bench.common import ROOT, machine_lines, machine_record, median, running_server, spread, write_results
from bench.gate_decision import measure
from bench.prompts_fixed import DECODE_PROMPTS
from specgate.contract import engine_inputs
from specgate_client import GenerateParams, GrpcClient, stream_engine
from specgate_launcher import engine_key


def tpot_ms(points: list[tuple[float, int]]) -> float:
    """ms per token after the first response: (t_last - t_first) / (tokens_last - tokens_first).

    Speculative responses carry several tokens each, so tokens are counted, not responses.
    """
    (t0, n0), (t1, n1) = points[0], points[-1]
    return 1000 * (t1 - t0) / max(n1 - n0, 1)


def direct(url: str, ids: list[int], n: int, algorithm: str, k: int, end_id: int) -> float:
    """TPOT of a streamed request straight to spec_engine (the engine contract, no gate)."""
    points: list[tuple[float, int]] = []
    tokens = 0
    params = {"speculative_algorithm": algorithm, "num_speculative_tokens": k}
    for t, r in stream_engine(url, "spec_engine", engine_inputs(ids, n, end_id), parameters=params, engine_key=engine_key()):
        out = r.as_numpy("output_ids")
        if out is not None and out.size:
            tokens += out.size
            points.append((t, tokens))
    return tpot_ms(points)


def through_gate(client: GrpcClient, prompt: str, n: int, algorithm: str, k: int) -> tuple[float, str]:
    p = GenerateParams(max_tokens=n, speculative_algorithm=algorithm, num_speculative_tokens=k)
    chunks = list(client.stream(prompt, p, spec_mode="prod"))
    points = [(c.t, c.meta["num_output_tokens"]) for c in chunks if c.text]
    return tpot_ms(points), chunks[-1].meta["route"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--algorithm", default="ngram")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    machine = machine_record()
    from transformers import AutoTokenizer

    dec = measure(100_000, ROOT / "policy" / "default.yaml")
    print(f"[bench-gate] decide(): p50 {dec['p50_us']:.1f} us, p99 {dec['p99_us']:.1f} us", flush=True)

    tok = AutoTokenizer.from_pretrained(str(ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"))
    ids = [
        list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in DECODE_PROMPTS
    ]
    res: dict[str, list[float]] = {"direct": [], "gate": []}
    with running_server(ROOT / "artifacts" / "model_repository") as (ports, _):
        url = f"localhost:{ports.grpc}"
        gc = GrpcClient(url)
        direct(url, ids[0], 8, args.algorithm, args.k, tok.eos_token_id)  # warm-up
        for r in range(args.repeats):
            for prompt, pid in zip(DECODE_PROMPTS, ids):
                res["direct"].append(direct(url, pid, args.tokens, args.algorithm, args.k, tok.eos_token_id))
                t, route = through_gate(gc, prompt, args.tokens, args.algorithm, args.k)
                assert route == "speculative", f"the gate routed {route}; check policy/default.yaml"
                res["gate"].append(t)
            print(f"[bench-gate] repeat {r + 1}: direct {median(res['direct']):.1f} ms, gate {median(res['gate']):.1f} ms", flush=True)
    ratio = [g_ / d for g_, d in zip(res["gate"], res["direct"])]
    md = [
        "# bench-gate",
        "",
        f"Decision latency, `Gate.decide()` in-process, {dec['n']} mixed decisions: p50 {dec['p50_us']:.1f} us, "
        f"p99 {dec['p99_us']:.1f} us, max {dec['max_us']:.1f} us (target p99 < 100 us).",
        "",
        f"End to end, speculative ({args.algorithm}, k={args.k}), {args.tokens} tokens, "
        f"{len(DECODE_PROMPTS)} prompts x {args.repeats}, gRPC streaming:",
        "",
        "| path | TPOT ms |",
        "|---|---|",
        f"| spec_engine directly | {spread(res['direct'])} |",
        f"| llm -> spec_gate -> spec_engine | {spread(res['gate'])} |",
        "",
        f"- gate / direct TPOT, per pair: median {median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}] (target <= 1.05)",
        f"- command: `make bench-gate` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        *machine_lines(machine),
    ]
    print("\n".join(md))
    write_results("bench-gate", "\n".join(md) + "\n", {"args": vars(args), "machine": machine, "decision": dec, "tpot_ms": res})


if __name__ == "__main__":
    main()
