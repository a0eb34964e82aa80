"""Two llama.cpp builds in one process, their decodes alternated: ms per token of each.

For `make setup`'s native build against the images' portable one (build/install_llamacpp.py,
docs/deploy.md "The image"). Both builds' libraries carry the same names, so each is loaded into a
link namespace of its own (dlmopen); the decode loop is the same code for both, a greedy token at a
time with the engines' thread count over repacked weights, in exact mode (the served default) or
upstream's kernels. Rounds
alternate the order (A B B A ...), so a slow spell of the machine falls on both.

    python -m bench.llamacpp_builds --a NATIVE_LIB_DIR --b PORTABLE_LIB_DIR [--rounds 20] [--tokens 64]

A lib dir is a llama-cpp-python install's `llama_cpp/lib`.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import llama_cpp  # the structs' layouts only: both builds are llama-cpp-python 0.3.36
import numpy as np

from bench.common import GGUF, spread
from specgate.machine import machine

_libc = ctypes.CDLL(None)
_libc.dlmopen.restype = ctypes.c_void_p
_libc.dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
_libc.dlsym.restype = ctypes.c_void_p
_libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_libc.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
_libc.dlerror.restype = ctypes.c_char_p
RTLD_NOW, LM_ID_NEWLM, RTLD_DI_LMID = 2, -1, 1
_QUIET = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)  # llama.cpp's log lines


class Build:
    """One build's libllama in a namespace of its own, and the few calls a decode loop needs."""

    def __init__(self, lib_dir: Path) -> None:
        self.lib_dir = lib_dir
        llama = _libc.dlmopen(LM_ID_NEWLM, str(lib_dir / "libllama.so.0").encode(), RTLD_NOW)
        if not llama:
            raise OSError(_libc.dlerror().decode())
        self._lmid = ctypes.c_long()
        _libc.dlinfo(llama, RTLD_DI_LMID, ctypes.byref(self._lmid))
        ggml = self._open("libggml.so.0")  # by soname: the copy libllama loaded
        self._fn(llama, "llama_log_set", None, type(_QUIET), ctypes.c_void_p)(_QUIET, None)
        if any(lib_dir.glob("libggml-cpu-*.so")):  # portable: ggml picks the CPU variant, as load_backends does
            self._fn(ggml, "ggml_backend_load_all_from_path", None, ctypes.c_char_p)(str(lib_dir).encode())
        self._fn(llama, "llama_backend_init", None)()
        self.cpu_lib = next(p for p in _mapped() if p.parent == lib_dir and p.name.startswith("libggml-cpu"))
        self.set_batch_invariant = self._fn(self._open(str(self.cpu_lib)), "ggml_cpu_set_batch_invariant", None, ctypes.c_bool)
        f = lambda name, res, *args: self._fn(llama, name, res, *args)  # noqa: E731
        self.model_default_params = f("llama_model_default_params", llama_cpp.llama_model_params)
        self.context_default_params = f("llama_context_default_params", llama_cpp.llama_context_params)
        self.load_model = f("llama_model_load_from_file", ctypes.c_void_p, ctypes.c_char_p, llama_cpp.llama_model_params)
        self.init_context = f("llama_init_from_model", ctypes.c_void_p, ctypes.c_void_p, llama_cpp.llama_context_params)
        self.batch_get_one = f("llama_batch_get_one", llama_cpp.llama_batch, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32)
        self.decode = f("llama_decode", ctypes.c_int32, ctypes.c_void_p, llama_cpp.llama_batch)
        self.logits_ith = f("llama_get_logits_ith", ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int32)
        self.get_memory = f("llama_get_memory", ctypes.c_void_p, ctypes.c_void_p)
        self.memory_clear = f("llama_memory_clear", None, ctypes.c_void_p, ctypes.c_bool)
        self.n_vocab = f("llama_vocab_n_tokens", ctypes.c_int32, ctypes.c_void_p)
        self.model_vocab = f("llama_model_get_vocab", ctypes.c_void_p, ctypes.c_void_p)

    def _open(self, name: str) -> int:
        handle = _libc.dlmopen(self._lmid.value, name.encode(), RTLD_NOW)
        if not handle:
            raise OSError(_libc.dlerror().decode())
        return handle

    @staticmethod
    def _fn(handle: int, name: str, restype, *argtypes):  # noqa: ANN001, ANN205
        addr = _libc.dlsym(handle, name.encode())
        if not addr:
            raise OSError(f"{name}: {_libc.dlerror().decode()}")
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def _mapped() -> list[Path]:
    return [Path(line.split(maxsplit=5)[-1]) for line in Path("/proc/self/maps").read_text().splitlines() if "/" in line]


class Decoder:
    """A context of one build over the GGUF: prompt, then greedy tokens one decode each."""

    def __init__(self, build: Build, gguf: Path, threads: int, exact: bool) -> None:
        self.b, self.exact = build, exact
        mp = build.model_default_params()
        mp.use_extra_bufts = True  # repacked weights (AMX, CPU repack), as the engines load them (decoding/llamacpp_target.py)
        self.model = build.load_model(str(gguf).encode(), mp)
        cp = build.context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 1024, 512, threads, threads
        self.ctx = build.init_context(self.model, cp)
        if not (self.model and self.ctx):
            raise RuntimeError(f"{build.lib_dir}: could not load {gguf}")
        self.vocab = build.n_vocab(build.model_vocab(self.model))

    def _step(self, tokens: list[int]) -> int:
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        if self.b.decode(self.ctx, self.b.batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")
        return int(np.ctypeslib.as_array(self.b.logits_ith(self.ctx, -1), shape=(self.vocab,)).argmax())

    def ms_per_token(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        self.b.set_batch_invariant(self.exact)
        self.b.memory_clear(self.b.get_memory(self.ctx), True)
        out = [self._step(prompt)]
        start = time.perf_counter()
        for _ in range(tokens):
            out.append(self._step([out[-1]]))
        return (time.perf_counter() - start) * 1000 / tokens, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="the first build's llama_cpp/lib")
    ap.add_argument("--b", type=Path, required=True, help="the second build's llama_cpp/lib")
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens timed per round, after a 32-token prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--upstream", action="store_true", help="upstream's kernels (EXACT=0) instead of exact mode")
    args = ap.parse_args()
    builds = {"a": Build(args.a.resolve()), "b": Build(args.b.resolve())}
    decoders = {k: Decoder(b, args.gguf, args.threads, exact=not args.upstream) for k, b in builds.items()}
    prompt = list(range(1000, 1032))
    ms: dict[str, list[float]] = {k: [] for k in builds}
    outputs = {}
    for r in range(args.rounds):
        for k in ("a", "b") if r % 2 == 0 else ("b", "a"):
            t, outputs[k] = decoders[k].ms_per_token(prompt, args.tokens)
            ms[k].append(t)
    print(machine().line())
    print(f"{args.rounds} rounds of {args.tokens} greedy tokens, {args.threads} threads, "
          f"{'upstream kernels' if args.upstream else 'exact mode'}")
    for k, b in builds.items():
        print(f"  {k}: {spread(ms[k], '.2f')} ms/token  ({b.cpu_lib})")
    ratios = [b / a for a, b in zip(ms["a"], ms["b"])]
    print(f"  b / a per round: {spread(ratios, '.3f')} (mean {statistics.mean(ratios):.3f}); same tokens: {outputs['a'] == outputs['b']}")


if __name__ == "__main__":
    main()
