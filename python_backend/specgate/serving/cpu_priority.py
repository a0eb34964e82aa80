"""The server's own Python models step back on the CPU for the engines that share it.

On a CPU machine the engines' llama.cpp threads keep every core busy during a decode and meet at
spinning barriers many times per decode. A streamed response wakes preprocessing, spec_gate and
postprocessing (and the OpenAI front) on those cores: each wake-up that preempts one decode thread
leaves the other spinning until it runs again. Measured on a 2-core Xeon with 20 ms streaming, the
streamed baseline decoded at 12.6-12.7 ms per token with these processes at normal priority and at
11.6 ms with them at SCHED_IDLE, the in-process engine's speed (docs/engines.md, "Threads").

SCHED_IDLE threads run only when a core would otherwise idle (or for a sliver of time when none
does): between decodes, while the engine samples on one core, and whenever the engines wait. Under
sustained load they get less time, so streamed responses coalesce into fewer, larger ones; requests
are not lost or reordered. `SPECGATE_PIPELINE_PRIORITY=normal` keeps normal priority (a machine
whose engines run elsewhere, or an operator who prefers finer streams to decode speed).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

ENV = "SPECGATE_PIPELINE_PRIORITY"

log = logging.getLogger(__name__)


def yield_to_engines() -> None:
    """Put every thread of this process (and, by inheritance, those it starts later) at SCHED_IDLE."""
    if os.environ.get(ENV, "idle") != "idle" or not hasattr(os, "SCHED_IDLE"):
        return
    for tid in Path("/proc/self/task").iterdir():
        try:
            os.sched_setscheduler(int(tid.name), os.SCHED_IDLE, os.sched_param(0))
        except (ProcessLookupError, PermissionError) as exc:  # a thread that just ended; a sandbox that forbids it
            log.debug("thread %s keeps its priority: %s", tid.name, exc)
