"""`make bench-baseline`: greedy decoding of 128 tokens on a fixed prompt set, in one run:

- engine: the CPU engine called directly, in-process (BatchRunner, one request at a time)
- triton: the same engine through tritonserver (`llm`, HTTP generate_stream, speculation off)
- transformers: `generate` on the same weights and dtype

Runs are interleaved (engine, triton, transformers per prompt per repeat) so machine noise hits all
three alike. Reports median [min-max] decode tokens/s and TTFT, and the ratios the issue targets.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from bench.common import ROOT, median, running_server, spread, write_results
from bench.prompts_fixed import DECODE_PROMPTS
from specgate.client import GenerateParams, HttpClient
from specgate.engine.config import EngineConfig
from specgate.engine.model import load_llama
from specgate.engine.request import Event, GenerationRequest
from specgate.engine.runner import BatchRunner

CKPT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"


def run_engine(runner: BatchRunner, ids: list[int], n: int) -> tuple[float, float, int]:
    """(ttft_s, decode tok/s after the first token, tokens) for one request."""
    times: list[float] = []
    count = [0]
    done = threading.Event()

    def emit(ev: Event) -> None:
        if ev.tokens:
            times.append(time.perf_counter())
            count[0] += len(ev.tokens)
        if ev.finished:
            done.set()

    t0 = time.perf_counter()
    runner.submit(GenerationRequest(input_ids=ids, max_new_tokens=n), emit)  # no end_id: always n tokens
    done.wait()
    return times[0] - t0, (count[0] - 1) / (times[-1] - times[0]), count[0]


def run_transformers(model, ids: list[int], n: int) -> tuple[float, float, int]:
    """TTFT from a 1-token generate, decode rate from a full one (a streamer would skew the timing)."""
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    total = time.perf_counter() - t0
    produced = out.shape[1] - len(ids)
    return ttft, (produced - 1) / max(total - ttft, 1e-9), produced


def run_triton(client: HttpClient, prompt: str, n: int) -> tuple[float, float, int]:
    p = GenerateParams(max_tokens=n)
    chunks = list(client.stream(prompt, p, spec_mode="off"))
    text_chunks = [c for c in chunks if c.text]
    tokens = chunks[-1].meta["num_output_tokens"]
    return text_chunks[0].t, (tokens - 1) / (text_chunks[-1].t - text_chunks[0].t), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(str(CKPT))
    hf = AutoModelForCausalLM.from_pretrained(str(CKPT), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # always generate the full count, like the others
    cfg = EngineConfig(checkpoint_dir=CKPT, dtype=args.dtype, max_context=1024, max_batch_size=1)
    runner = BatchRunner(load_llama(CKPT, dtype, 1024), cfg)
    ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)["input_ids"]) for p in DECODE_PROMPTS]

    results: dict[str, dict[str, list[float]]] = {k: {"tps": [], "ttft_ms": []} for k in ("engine", "triton", "transformers")}
    repo = ROOT / "artifacts" / "model_repository"
    with running_server(repo) as ports:
        client = HttpClient(f"localhost:{ports.http}")
        run_triton(client, DECODE_PROMPTS[0], 8)  # warm-up
        run_engine(runner, ids[0], 8)
        for r in range(args.repeats):
            for prompt, pid in zip(DECODE_PROMPTS, ids):
                for name, fn in (
                    ("engine", lambda: run_engine(runner, pid, args.tokens)),
                    ("triton", lambda: run_triton(client, prompt, args.tokens)),
                    ("transformers", lambda: run_transformers(hf, pid, args.tokens)),
                ):
                    ttft, tps, _ = fn()
                    results[name]["tps"].append(tps)
                    results[name]["ttft_ms"].append(1000 * ttft)
            print(f"[bench-baseline] repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {median(v['tps']):.1f} tok/s" for k, v in results.items()), flush=True)
    runner.shutdown()

    eng, tri, hf_tps = (median(results[k]["tps"]) for k in ("engine", "triton", "transformers"))
    md = [
        f"# bench-baseline ({args.dtype}, greedy, {args.tokens} new tokens, {len(DECODE_PROMPTS)} prompts x {args.repeats} repeats)",
        "",
        "| path | decode tok/s | TTFT ms |",
        "|---|---|---|",
        *(f"| {k} | {spread(v['tps'])} | {spread(v['ttft_ms'])} |" for k, v in results.items()),
        "",
        f"- engine / transformers: {eng / hf_tps:.2f}x (target >= 1.0)",
        f"- triton / engine: {tri / eng:.2f} (target >= 0.90: Triton costs at most 10%)",
        f"- command: `make bench-baseline` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
    ]
    print("\n".join(md))
    write_results("bench-baseline", "\n".join(md) + "\n", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
