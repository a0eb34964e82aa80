"""Install llama-cpp-python, built from source for this CPU's instruction sets (`make setup`).

Why by hand: pip builds llama.cpp with `-march=native`, which also turns on AMX where the CPU has
it, and ggml's AMX path segfaults on some Sapphire Rapids machines (ggml-org/llama.cpp#20824, seen
here on the first decode). So the instruction sets are chosen from /proc/cpuinfo instead, AMX off,
and the wheel is kept in a cache keyed by that choice: a wheel built on one CPU is never installed
on a CPU that lacks its instructions (pip's own wheel cache is keyed by the source only).

`LLAMA_CPP_CMAKE_ARGS` replaces the chosen flags (e.g. `-DGGML_NATIVE=OFF` alone builds the
AVX2-only variant that stands in for an AVX2 machine on a newer one).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"  # pinned: the engine is tested against this llama.cpp (vendored in the sdist)
CACHE = Path(os.environ.get("SPECGATE_WHEEL_CACHE", Path.home() / ".cache" / "specgate" / "wheels"))

# ggml CMake option -> the /proc/cpuinfo flags it needs (x86-64). AMX stays off (see above).
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
    override = os.environ.get("LLAMA_CPP_CMAKE_ARGS")
    if override is not None:
        return override
    if not flags:  # not x86 Linux: let llama.cpp tune for the build machine itself
        return "-DGGML_NATIVE=ON"
    opts = [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in _OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *opts, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def _log(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def main() -> None:
    python = sys.executable
    args = cmake_args(cpu_flags())
    key = hashlib.sha256(f"{VERSION} {args}".encode()).hexdigest()[:16]
    wheel_dir = CACHE / f"llama-cpp-python-{VERSION}-{key}"
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        _log(f"building llama-cpp-python {VERSION} from source (llama.cpp; several minutes on 2 cores)")
        _log(f"CMAKE_ARGS={args}")
        start = time.monotonic()
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = [python, "-m", "pip", "wheel", "--quiet", "--no-cache-dir", "--no-deps", f"llama-cpp-python=={VERSION}", "-w", str(wheel_dir)]
        if subprocess.run(cmd, env={**os.environ, "CMAKE_ARGS": args}).returncode != 0:
            raise SystemExit("[setup] error: building llama-cpp-python failed (it needs cmake and a C++ compiler)")
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
