"""The llama.cpp / ggml functions that llama-cpp-python does not bind: its thread pool API and the
batch-invariance switch that `make setup` patches into ggml (build/llamacpp_patch.py).

By hand (ctypes) because llama-cpp-python 0.3.36 leaves `llama_attach_threadpool` as a TODO and
knows nothing of the patch.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

GGML_MAX_N_THREADS = 512  # ggml.h: the size of ggml_threadpool_params.cpumask


class ThreadpoolParams(ctypes.Structure):
    """`struct ggml_threadpool_params` (ggml.h)."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


def loaded(lib_dir: Path, name: str) -> Path:
    """The file of library `name` that this process has loaded already.

    The wheel holds copies, not links, of each library under its versioned names (libggml-cpu.so,
    .so.0, ...), and llama.cpp loads them by soname. Opening another copy would load a second
    instance with its own globals: a thread pool or a switch set there is not the one llama.cpp's
    decodes use (seen: the pool's workers ran one copy's kernels, the caller the other's).
    """
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1]
        if Path(path).name.startswith(name + ".so") and Path(path).parent == lib_dir:
            return Path(path)
    raise RuntimeError(f"{name} from {lib_dir} is not loaded (import llama_cpp first)")


class Native:
    def __init__(self, lib_dir: Path) -> None:
        cpu = ctypes.CDLL(str(loaded(lib_dir, "libggml-cpu")))
        llama = ctypes.CDLL(str(loaded(lib_dir, "libllama")))
        cpu.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams), ctypes.c_int]
        cpu.ggml_threadpool_params_init.restype = None
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        llama.llama_attach_threadpool.restype = None
        self._cpu, self._llama = cpu, llama
        self._invariant = getattr(cpu, "ggml_cpu_set_batch_invariant", None)
        if self._invariant is not None:
            self._invariant.argtypes = [ctypes.c_bool]
            self._invariant.restype = None
        self._invariant_on: bool | None = None

    # -- thread pool ------------------------------------------------------------------------------
    def threadpool(self, n_threads: int, poll: int) -> int:
        """A persistent pool of `n_threads` (the caller's thread is one of them). `poll` 0..100 is how
        long idle workers spin before they sleep; 0: they sleep as soon as a decode ends."""
        p = ThreadpoolParams()
        self._cpu.ggml_threadpool_params_init(ctypes.byref(p), n_threads)
        p.poll = poll
        pool = self._cpu.ggml_threadpool_new(ctypes.byref(p))
        if not pool:
            raise RuntimeError(f"ggml could not start a thread pool of {n_threads} threads")
        return pool

    def attach(self, ctx: int, pool: int) -> None:
        """Decodes of `ctx` (prompt batches and single tokens alike) run on `pool`."""
        self._llama.llama_attach_threadpool(ctx, pool, pool)

    def free_threadpool(self, pool: int) -> None:
        self._cpu.ggml_threadpool_free(pool)

    # -- batch invariance (the patch) -------------------------------------------------------------
    @property
    def has_batch_invariance(self) -> bool:
        return self._invariant is not None

    def set_batch_invariant(self, on: bool) -> None:
        """Process-wide: set before each decode by the target that runs it."""
        if on == self._invariant_on:
            return
        if self._invariant is None:
            if on:
                raise RuntimeError(
                    "this llama-cpp-python build lacks the batch-invariance patch that exact mode needs; "
                    "reinstall it with `make setup` (build/install_llamacpp.py)"
                )
            return
        self._invariant(on)
        self._invariant_on = on


@lru_cache(maxsize=1)
def native() -> Native:
    import llama_cpp

    return Native(Path(llama_cpp.__file__).parent / "lib")
