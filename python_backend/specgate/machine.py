"""The machine an engine runs on: CPU model and the instruction sets that decide its speed.

Every benchmark, the engines' start-up log and `results/*.json` record this, because the same code
runs at very different speeds (and with different cost curves) on different CPUs.
"""

from __future__ import annotations

import math
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


def cpu_quota(cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs per period this process's cgroup may use (a container's CPU limit), or None if unlimited.

    A pod's container sees every core of its node in its affinity mask, whatever its limit, and unless
    the pod is Guaranteed with whole CPUs it is never pinned; threads beyond the quota only wait for
    it. cgroup v2: `cpu.max` ("200000 100000"; "max ..." is none) of this process's cgroup and of each
    above it, the smallest; v1 (and hybrid hosts, where the cpu controller is v1's): cpu.cfs_quota_us /
    cpu.cfs_period_us of the cpu hierarchy (-1: none). A cgroup path not under the mount (no cgroup
    namespace) reads the mount's own root, the container's cgroup.
    """
    try:
        lines = [line.split(":", 2) for line in own.read_text().splitlines()]
    except OSError:
        return None
    v1 = next((path for _, ctrls, path in lines if "cpu" in ctrls.split(",")), None)
    if v1 is not None:
        mount = next((d for d in cgroups.glob("*") if "cpu" in d.name.split(",") and d.is_dir()), None)
        if mount is None:
            return None
        folder = mount / v1.lstrip("/") if (mount / v1.lstrip("/")).is_dir() else mount
        try:
            quota, period = int((folder / "cpu.cfs_quota_us").read_text()), int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            return None
        return quota / period if quota > 0 and period > 0 else None
    v2 = next((path for hid, ctrls, path in lines if hid == "0" and not ctrls), None)
    if v2 is None:
        return None
    folder = cgroups / v2.lstrip("/") if (cgroups / v2.lstrip("/")).is_dir() else cgroups
    limits = []
    for d in (folder, *folder.parents):
        if not d.is_relative_to(cgroups):
            break
        try:
            quota, period = (d / "cpu.max").read_text().split()
        except (OSError, ValueError):
            continue
        if quota != "max":
            limits.append(int(quota) / int(period))
    return min(limits, default=None)


def usable_cores(affinity: int, quota: float | None) -> int:
    """Threads worth running: the cores this process may run on, at most its CPU quota rounded up."""
    return max(1, min(affinity, math.ceil(quota))) if quota else affinity


@lru_cache(maxsize=1)
def machine() -> Machine:
    model, flags = _cpuinfo()
    return Machine(cpu_model=model, cores=usable_cores(len(os.sched_getaffinity(0)), cpu_quota()), isa={f: f in flags for f in ISA_FLAGS})
