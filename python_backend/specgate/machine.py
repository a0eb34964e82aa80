"""The machine an engine runs on: CPU model and the instruction sets that decide its speed.

Every benchmark, the engines' start-up log and `results/*.json` record this, because the same code
runs at very different speeds (and with different cost curves) on different CPUs.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

# The flags that change which kernels run: AVX2-only machines vs native bf16 (AVX512_BF16 / AMX).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


class Machine(BaseModel):
    cpu_model: str
    cores: int
    isa: dict[str, bool]

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (AVX512_BF16 or AMX); elsewhere bf16 is emulated and slower than fp32."""
        return self.isa.get("avx512_bf16", False) or self.isa.get("amx_bf16", False)

    def line(self) -> str:
        flags = " ".join(f for f, on in self.isa.items() if on) or "none of " + "/".join(ISA_FLAGS)
        return f"{self.cpu_model}, {self.cores} cores, ISA: {flags}"


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags and model:
                break
    except OSError:
        pass
    return model, flags


def wait_until_idle(max_busy: float = 0.1, window_s: float = 1.0, timeout_s: float = 120.0) -> float:
    """Wait until the whole machine is idle: at most `max_busy` of its CPU time used over `window_s`.

    Measuring while something else computes (a server's other models loading, a benchmark's other
    processes) measures the contention: spec_engine once published a one-token decode at 6x its
    true cost that way. Returns the busy fraction seen last; gives up after `timeout_s`.
    """
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        busy = psutil.cpu_percent(interval=window_s) / 100
        if busy <= max_busy or time.monotonic() > deadline:
            return busy


@lru_cache(maxsize=1)
def machine() -> Machine:
    model, flags = _cpuinfo()
    return Machine(cpu_model=model, cores=len(os.sched_getaffinity(0)), isa={f: f in flags for f in ISA_FLAGS})
