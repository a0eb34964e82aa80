"""Install llama-cpp-python, built from source for this CPU's instruction sets (`make setup`).

Three choices are made here rather than by pip's own build:
- the instruction sets (below);
- ggml's own thread pool instead of OpenMP (`-DGGML_OPENMP=OFF`, always): the engines decode from
  worker threads, and with OpenMP a second thread that ever ran a parallel region (a decode, or a
  PyTorch op with more than one thread) puts libgomp into its throttled mode for the whole process,
  where waiting threads sleep instead of spinning: decodes ran 2.9x slower (docs/engines.md, "Threads");
- the patch to llama.cpp's CPU kernels (build/llamacpp_patch.py): the batch-invariance switch the
  engines' exact mode turns on, and the kernels that keep it fast.

Why by hand: the instruction sets are chosen from /proc/cpuinfo (AMX included where the CPU has it:
the patch fixes the tile-configuration bug that made ggml's AMX kernels raise SIGILL on their first
tile load when built with GCC 12, ggml-org/llama.cpp#20824), and the wheel is kept in a cache keyed
by that choice: a wheel built on one CPU is never installed on a CPU that lacks its instructions
(pip's own wheel cache is keyed by the source only).

`LLAMA_CPP_CMAKE_ARGS` replaces the chosen instruction-set flags (e.g. `-DGGML_NATIVE=OFF` alone
builds the AVX2-only variant that stands in for an AVX2 machine on a newer one); the thread pool and
the patch stay.

`LLAMA_CPP_BUILD=portable` (the images, deploy/Dockerfile) builds for any x86-64 CPU instead: ggml's
runtime CPU dispatch, one CPU backend library per instruction-set level, the best one for the CPU
loaded at start (specgate.decoding.llamacpp_native.load_backends). An image built on an AVX-512
machine then runs on an AVX2 node instead of dying there with SIGILL. The patch edits the sources
every variant is compiled from, so exact mode and the AMX fix hold on each (the AMX variant,
sapphirerapids, died of SIGILL at its first tile load before that fix, here as in a native build).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_patch  # noqa: E402 (a sibling file: this script runs before the project is installed)

VERSION = "0.3.36"  # pinned: the engine is tested against this llama.cpp (vendored in the sdist)
ALWAYS = "-DGGML_OPENMP=OFF"  # ggml's thread pool, whatever the instruction sets (see above)
# Every x86-64 level as a library of its own, installed beside libggml.so in the package (ggml installs
# them to the bin folder; STRING keeps the path relative to the wheel's root); no multimodal library,
# which the engines never load.
PORTABLE = "-DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF -DCMAKE_INSTALL_BINDIR:STRING=llama_cpp/lib -DLLAVA_BUILD=OFF"
CACHE = Path(os.environ.get("SPECGATE_WHEEL_CACHE", Path.home() / ".cache" / "specgate" / "wheels"))

# ggml CMake option -> the /proc/cpuinfo flags it needs (x86-64)
_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
    # ggml's AMX kernels are built only with AVX512-VNNI beside AMX-INT8 (ggml-cpu/amx/amx.h)
    "GGML_AMX_TILE": ("amx_tile",),
    "GGML_AMX_INT8": ("amx_int8", "avx512_vnni"),
    "GGML_AMX_BF16": ("amx_bf16",),
}


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_args(flags: set[str]) -> str:
    build = os.environ.get("LLAMA_CPP_BUILD", "native")
    if build == "portable":
        return PORTABLE
    if build != "native":
        raise SystemExit(f"[setup] error: LLAMA_CPP_BUILD={build!r}: native (this CPU, the default) or portable (any x86-64 CPU)")
    override = os.environ.get("LLAMA_CPP_CMAKE_ARGS")
    if override is not None:
        return override
    if not flags:  # not x86 Linux: let llama.cpp tune for the build machine itself
        return "-DGGML_NATIVE=ON"
    opts = [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in _OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *opts])


def extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Unpack the sdist with tarfile's "data" filter where this Python has it (3.11.4 on). Debian 12's
    python3 is 3.11.2, whose extractall takes no filter: there the same refusals by hand, of any member
    but a plain file or folder and of any path that leaves `dest` (the sdist holds only those two)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = dest.resolve()
    for m in tar.getmembers():
        if not (m.isfile() or m.isdir()) or not (root / m.name).resolve().is_relative_to(root):
            raise SystemExit(f"[setup] error: refusing to unpack {m.name!r} from {tar.name}: not a plain file or folder inside the archive")
    tar.extractall(dest)


def build_wheel(python: str, args: str, wheel_dir: Path) -> None:
    """Download the sdist, patch its llama.cpp, and build a wheel from it into `wheel_dir`."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-python-") as tmp:
        cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit("[setup] error: downloading the llama-cpp-python source failed")
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            extract(tar, Path(tmp))
        src = Path(tmp) / sdist.name.removesuffix(".tar.gz")
        llamacpp_patch.apply(src / "vendor" / "llama.cpp")
        cmd = [python, "-m", "pip", "wheel", "--quiet", "--no-cache-dir", "--no-deps", str(src), "-w", str(wheel_dir)]
        if subprocess.run(cmd, env={**os.environ, "CMAKE_ARGS": args}).returncode != 0:
            raise SystemExit("[setup] error: building llama-cpp-python failed (it needs cmake and a C++ compiler)")


def _log(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def main() -> None:
    python = sys.executable
    args = f"{cmake_args(cpu_flags())} {ALWAYS}"
    key = hashlib.sha256(f"{VERSION} {args} {llamacpp_patch.fingerprint()}".encode()).hexdigest()[:16]
    wheel_dir = CACHE / f"llama-cpp-python-{VERSION}-{key}"
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        _log(f"building llama-cpp-python {VERSION} from source, patched (llama.cpp; several minutes on 2 cores)")
        _log(f"CMAKE_ARGS={args}")
        start = time.monotonic()
        wheel_dir.mkdir(parents=True, exist_ok=True)
        build_wheel(python, args, wheel_dir)
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
        _log(f"built {wheels[-1].name} in {time.monotonic() - start:.0f} s (cached in {wheel_dir})")
    else:
        _log(f"llama-cpp-python wheel for this CPU found in {wheel_dir}")
    # --force-reinstall --no-deps: replace a wheel built for other flags; its dependencies come from pyproject
    cmd = [python, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheels[-1])]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"[setup] error: installing {wheels[-1]} failed")


if __name__ == "__main__":
    main()
