"""Decoding in a fresh process of its own: the peer a CPU user would pick instead of us, and the floor.

- `peer`: llama-cpp-python's own decode loop (`Llama.generate`, its own sampler), the same GGUF, threads
  and context size as our engine. The process imports llama_cpp and nothing of ours.
- `floor`: our engine's decode with nothing around it: `LlamaCppTarget.forward` of one token and a
  numpy argmax, in a loop on the process's main thread (greedy only). What every served path is
  measured against: it is the speed the engine's own context settings allow.
- `engine`: the baseline engine's scheduler (`BatchRunner`, one request at a time) in-process, as
  `target_engine` runs it but without Triton.

Each runs in a fresh `python -c` started by `DecodeProcess`, never a child forked or spawned from a
process that holds an engine: two llama.cpp contexts in one process, or an engine's threads beside
the peer's, slowed the peer about 3x on a 2-core machine (docs/engines.md, "Threads"). The caller
must keep everything else of ours idle while one runs. Requests and results travel as JSON lines
over the child's stdin/stdout. KV caches are cleared before every request (no prefix reuse).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

ROOT = Path(__file__).resolve().parent.parent
Mode = Literal["peer", "floor", "engine"]


@dataclass
class PeerRun:
    tokens: list[int]
    ttft_s: float
    tpot_ms: float  # (last - first token) / (tokens - 1)


class DecodeProcess:
    """One decoding process (`mode`), kept for many requests; `run` sends one and waits for it."""

    def __init__(self, mode: Mode, gguf: Path, n_ctx: int, threads: int, exact: bool = True) -> None:
        code = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'python_backend')!r}]; from bench.peer import serve; serve()"
        self.mode = mode
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self._send({"mode": mode, "gguf": str(gguf), "n_ctx": n_ctx, "threads": threads, "exact": exact})
        if self._recv() != "ready":
            raise RuntimeError(f"the {mode} process did not start")

    def run(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0, eos: int | None = None) -> PeerRun:
        self._send({"ids": ids, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "eos": eos})
        return PeerRun(**self._recv())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            self._proc.wait(timeout=30)

    def _send(self, msg: dict) -> None:
        self._proc.stdin.write(json.dumps(msg) + "\n")  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]

    def _recv(self) -> Any:
        line = self._proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the {self.mode} process exited (code {self._proc.poll()})")
        return json.loads(line)


def Peer(gguf: Path, n_ctx: int, threads: int) -> DecodeProcess:  # noqa: N802 (the peer is one mode of DecodeProcess)
    return DecodeProcess("peer", gguf, n_ctx, threads)


# -- the child side: runs in the fresh process --------------------------------------------------------
def serve() -> None:
    setup = json.loads(sys.stdin.readline())
    decode = {"peer": _peer, "floor": _floor, "engine": _engine}[setup["mode"]](setup)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(asdict(decode(job["ids"], job["max_tokens"], job["temperature"], job["seed"], job["eos"]))), flush=True)


def _timed(start: float, times: list[float], out: list[int]) -> PeerRun:
    tpot = 1000 * (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return PeerRun(out, times[0] - start, tpot)


def _take(start: float, tokens: Iterator[int], max_tokens: int, eos: int | None) -> PeerRun:
    """Take tokens until EOS or max_tokens, timing each as it arrives (EOS's arrival included)."""
    times: list[float] = []
    out: list[int] = []
    for tok in tokens:
        times.append(time.perf_counter())
        if tok == eos:
            break
        out.append(tok)
        if len(out) >= max_tokens:
            break
    return _timed(start, times, out)


def _peer(setup: dict):  # noqa: ANN202
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=setup["gguf"], n_ctx=setup["n_ctx"], n_threads=setup["threads"], n_threads_batch=setup["threads"], n_batch=512,
        verbose=False,
    )

    def decode(ids: list[int], max_tokens: int, temperature: float, seed: int, eos: int | None) -> PeerRun:
        llm.reset()
        llm._ctx.kv_cache_clear()  # no prefix reuse across requests
        llm.set_seed(seed)
        start = time.perf_counter()
        # temperature only (top-k / top-p / min-p off), like the engines' default sampling
        return _take(start, llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=False),
                     max_tokens, eos)

    return decode


def _config(setup: dict, **extra: Any):  # noqa: ANN202
    """The engine config of one sequence that the floor and the engine path share."""
    from specgate.decoding.config import EngineConfig

    return EngineConfig(model=Path(setup["gguf"]), max_context=setup["n_ctx"], max_batch_size=1, num_threads=setup["threads"],
                        exact=setup["exact"], **extra)


def _floor(setup: dict):  # noqa: ANN202
    import numpy as np

    from specgate.decoding.loading import load_target

    # built as the engines build it (load_target also gives torch one thread beside llama.cpp's pool)
    cfg = _config(setup)
    target = load_target(cfg, cfg.model, num_slots=1, exact=cfg.exact)

    def decode(ids: list[int], max_tokens: int, temperature: float, seed: int, eos: int | None) -> PeerRun:
        if temperature > 0:
            raise ValueError("the floor decodes greedily")
        target.release(0)
        start = time.perf_counter()

        def tokens() -> Iterator[int]:  # lazily: no decode past the last token taken
            logits, _ = target.prefill(0, ids, features=False)
            tok = int(np.argmax(logits))
            while True:
                yield tok
                tok = int(np.argmax(target.forward([(0, [tok])])[0]))

        return _take(start, tokens(), max_tokens, eos)

    return decode


def _engine(setup: dict):  # noqa: ANN202
    import threading

    from specgate.decoding.batch_runner import BatchRunner
    from specgate.decoding.loading import load_target
    from specgate.decoding.request import Event, GenerationRequest
    from specgate.decoding.sampling import SamplingParams

    cfg = _config(setup, queue_timeout_s=1e6)
    runner = BatchRunner(load_target(cfg, cfg.model, num_slots=1, exact=cfg.exact), cfg)

    def decode(ids: list[int], max_tokens: int, temperature: float, seed: int, eos: int | None) -> PeerRun:
        times: list[float] = []
        out: list[int] = []
        done = threading.Event()

        def emit(ev: Event) -> None:
            for tok in ev.tokens:
                times.append(time.perf_counter())
                out.append(tok)
            if ev.finished:
                done.set()

        start = time.perf_counter()
        runner.submit(GenerationRequest(input_ids=ids, max_new_tokens=max_tokens, end_id=eos,
                                        sampling=SamplingParams(temperature=temperature, seed=seed)), emit)
        done.wait()
        return _timed(start, times, out)

    return decode
