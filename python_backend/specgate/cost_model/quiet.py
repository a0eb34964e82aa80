"""Whether the rest of the machine computed while a measurement ran.

A calibration measured while something else computes measures the contention: the first request a
fresh server serves, the other engine's decodes, another model loading. On a 2-core machine one
such overlap bent a published curve to cost(2)/cost(1) = 1.18 against 1.67-1.76 quiet, and moved a
drafter's measured cost 3x between two starts. So each repetition of a measurement is timed beside
the CPU time the rest of the machine used meanwhile (every busy jiffy of every core, this process's
own excluded, the hypervisor's steal included), and a repetition that overlapped more than
`MAX_OTHERS` of the machine is measured again rather than counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

MAX_OTHERS = 0.05  # share of the machine's CPU time others may use during a counted repetition


def _busy_s() -> float:
    """CPU seconds every core spent on anything but idling, since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


@dataclass
class Overlap:
    """Use as a context manager around one repetition; `others` is then the share of the machine's
    CPU time (0..1) that other processes (or the hypervisor) took while it ran."""

    others: float = 0.0

    def __enter__(self) -> "Overlap":
        self._start = (time.monotonic(), _busy_s(), _own_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        wall = time.monotonic() - wall0
        capacity = wall * (psutil.cpu_count() or 1)
        if capacity > 0:
            # jiffies make both readings coarse (10 ms): a short repetition reads 0 or a whole tick
            self.others = max(0.0, (_busy_s() - busy0) - (_own_s() - own0)) / capacity

    @property
    def quiet(self) -> bool:
        return self.others <= MAX_OTHERS
