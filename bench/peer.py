"""The peer a CPU user would pick instead of us: llama-cpp-python's own plain decoding of the same GGUF.

`Llama.generate` is llama-cpp-python's decode loop (one `llama_decode` per token, its own sampler),
with the same threads and context size as our engine. It runs in a process of its own, as a user
would run it: beside another llama.cpp context in the same process, our engine decoded 2.7x slower
(30 vs 80 tok/s), which would flatter the peer's comparison and skew ours. Its KV cache is cleared
before every request: it would otherwise reuse the previous request's prefix, which our engines do not.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PeerRun:
    tokens: list[int]
    ttft_s: float
    tpot_ms: float  # (last - first token) / (tokens - 1)


def _serve(conn, gguf: str, n_ctx: int, threads: int) -> None:  # noqa: ANN001 (runs in the child)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the benchmark exited without close()
            return
        if job is None:
            return
        ids, max_tokens, temperature, seed, eos = job
        llm.reset()
        llm._ctx.kv_cache_clear()  # no prefix reuse across requests
        llm.set_seed(seed)
        start = time.perf_counter()
        times: list[float] = []
        out: list[int] = []
        # temperature only (top-k / top-p / min-p off), like the engines' default sampling
        for tok in llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=False):
            times.append(time.perf_counter())
            if tok == eos:
                break
            out.append(tok)
            if len(out) >= max_tokens:
                break
        tpot = 1000 * (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
        conn.send(PeerRun(out, times[0] - start, tpot))


class Peer:
    def __init__(self, gguf: Path, n_ctx: int, threads: int) -> None:
        self._conn, child = mp.get_context("spawn").Pipe()
        self._proc = mp.get_context("spawn").Process(target=_serve, args=(child, str(gguf), n_ctx, threads), daemon=True)
        self._proc.start()

    def run(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0, eos: int | None = None) -> PeerRun:
        self._conn.send((ids, max_tokens, temperature, seed, eos))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=30)
