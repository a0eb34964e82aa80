"""The llama.cpp / ggml functions that llama-cpp-python does not bind: its thread pool API, the
switches that `make setup` patches into ggml (build/llamacpp_patch.py) and ggml's GGUF
reader; and where llama.cpp's own log lines go. Without torch: build/make_draft_model.py reads GGUFs
with it too.

By hand (ctypes) because llama-cpp-python 0.3.36 leaves `llama_attach_threadpool` as a TODO, knows
nothing of the patch and binds no gguf_* function. ggml's reader, not gguf-py's GGUFReader, finds
tensors: the latter builds a numpy view of every metadata element first, 3 s of every EAGLE
engine's start for this model's 49k-token vocabulary, against milliseconds.
"""

from __future__ import annotations

import ctypes
import logging
from fnmatch import fnmatch
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

GGML_MAX_N_THREADS = 512  # ggml.h: the size of ggml_threadpool_params.cpumask

_LOG_CALLBACK = None  # kept alive: llama.cpp calls it from C


def quiet_logs(L) -> None:  # type: ignore[no-untyped-def]
    """Route llama.cpp's own log lines to logging at debug level (they go to stderr otherwise)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = L.llama_log_callback(lambda level, text, _: log.debug(text.decode(errors="replace").rstrip()))
        L.llama_log_set(_LOG_CALLBACK, None)
        load_backends(_lib_dir(L))
        L.llama_backend_init()


class GgufInitParams(ctypes.Structure):
    """`struct gguf_init_params` (gguf.h)."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


class GgufTensor(NamedTuple):
    """Where a tensor's data lies in its GGUF file."""

    ggml_type: int  # enum ggml_type (gguf-py: GGMLQuantizationType)
    offset: int  # bytes from the start of the file
    nbytes: int


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


def loaded(lib_dir: Path, name: str, maps: Path = Path("/proc/self/maps")) -> Path:
    """The file of library `name` (a glob: `libggml-cpu*`) that this process has loaded already.

    The wheel holds copies, not links, of each library under its versioned names (libggml-cpu.so,
    .so.0, ...), and llama.cpp loads them by soname. Opening another copy would load a second
    instance with its own globals: a thread pool or a switch set there is not the one llama.cpp's
    decodes use (seen: the pool's workers ran one copy's kernels, the caller the other's). A portable
    build's CPU backend is the one variant ggml chose at start, libggml-cpu-<level>.so.
    """
    lib_dir = lib_dir.resolve()  # the maps name resolved paths: a venv reached through a link names another
    for line in maps.read_text().splitlines():
        path = Path(line.split(maxsplit=5)[-1])
        if path.parent == lib_dir and fnmatch(path.name, name + ".so*"):
            return path
    raise RuntimeError(f"{name} from {lib_dir} is not loaded (import llama_cpp first)")


def load_backends(lib_dir: Path) -> None:
    """Register the CPU backend of a portable build (build/install_llamacpp.py): ggml picks the best of
    its variants, libggml-cpu-<level>.so, for this CPU. Before llama_backend_init, which would search
    only beside the executable (python's folder) and in the working directory. A native build's one
    CPU backend is linked in and registered already."""
    if not any(lib_dir.glob("libggml-cpu-*.so")):
        return
    ggml = ctypes.CDLL(str(loaded(lib_dir, "libggml")))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_reg_count() == 0:
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())


class Native:
    def __init__(self, lib_dir: Path) -> None:
        base = ctypes.CDLL(str(loaded(lib_dir, "libggml-base")))
        cpu = ctypes.CDLL(str(loaded(lib_dir, "libggml-cpu*")))
        llama = ctypes.CDLL(str(loaded(lib_dir, "libllama")))
        cpu.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams), ctypes.c_int]
        cpu.ggml_threadpool_params_init.restype = None
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        llama.llama_attach_threadpool.restype = None
        base.gguf_init_from_file.argtypes = [ctypes.c_char_p, GgufInitParams]
        base.gguf_init_from_file.restype = ctypes.c_void_p
        base.gguf_free.argtypes = [ctypes.c_void_p]
        base.gguf_free.restype = None
        base.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
        base.gguf_get_data_offset.restype = ctypes.c_size_t
        base.gguf_find_tensor.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        base.gguf_find_tensor.restype = ctypes.c_int64
        for name, restype in (("offset", ctypes.c_size_t), ("type", ctypes.c_int), ("size", ctypes.c_size_t)):
            getattr(base, f"gguf_get_tensor_{name}").argtypes = [ctypes.c_void_p, ctypes.c_int64]
            getattr(base, f"gguf_get_tensor_{name}").restype = restype
        self._base, self._cpu, self._llama = base, cpu, llama
        self._invariant = getattr(cpu, "ggml_cpu_set_batch_invariant", None)
        if self._invariant is not None:
            self._invariant.argtypes = [ctypes.c_bool]
            self._invariant.restype = None
        self._invariant_on: bool | None = None
        self._tiles = getattr(cpu, "ggml_cpu_set_tile_kernels", None)
        if self._tiles is not None:
            self._tiles.argtypes = [ctypes.c_bool]
            self._tiles.restype = None

    # -- GGUF files ------------------------------------------------------------------------------
    def gguf_tensors(self, path: Path, names: list[str]) -> dict[str, GgufTensor]:
        """Where the tensors `names` lie in the GGUF at `path`; those it lacks are left out."""
        ctx = self._base.gguf_init_from_file(str(path).encode(), GgufInitParams(no_alloc=True, ctx=None))
        if not ctx:
            raise RuntimeError(f"ggml could not read {path} as a GGUF file")
        try:
            data = self._base.gguf_get_data_offset(ctx)
            found = {name: self._base.gguf_find_tensor(ctx, name.encode()) for name in names}
            return {
                name: GgufTensor(self._base.gguf_get_tensor_type(ctx, i), data + self._base.gguf_get_tensor_offset(ctx, i),
                                 self._base.gguf_get_tensor_size(ctx, i))
                for name, i in found.items()
                if i >= 0
            }
        finally:
            self._base.gguf_free(ctx)

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

    def cpu_function(self, name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
        """A function of the loaded CPU backend (the patch's EAGLE kernel), or None where this build lacks it."""
        return getattr(self._cpu, name, None)

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

    def set_tile_kernels(self, on: bool) -> None:
        """Process-wide: the patch's tile matmul kernels and blocked attention (on, the default), or the
        per-row kernels of the earlier exact mode (off): benchmarks measure one against the other."""
        if self._tiles is None:
            raise RuntimeError("this llama-cpp-python build predates the tile kernels; reinstall it with `make setup`")
        self._tiles(on)


def _lib_dir(llama_cpp) -> Path:  # type: ignore[no-untyped-def]
    return Path(llama_cpp.__file__).parent / "lib"


@lru_cache(maxsize=1)
def native() -> Native:
    import llama_cpp

    load_backends(_lib_dir(llama_cpp))  # a portable build's CPU library is loaded only then
    return Native(_lib_dir(llama_cpp))
