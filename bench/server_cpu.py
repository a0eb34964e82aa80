"""CPU time a running tritonserver's processes spend, by model: where a streamed response's cost goes.

Each Python-backend model runs in stubs of its own (children of tritonserver, named by the model.py
they load), so the difference between two readings shows what each hop of a request did. An engine's
own share cannot be read this way: its decode threads spin at their barriers for as long as the
decode takes, so its CPU time follows the wall time, not the work.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import psutil


def process_name(proc: psutil.Process, server_pid: int) -> str:
    """"tritonserver" for the server; for a Python-backend stub the model it serves (the directory
    above its version directory, from the model.py path on its command line); else the process name."""
    if proc.pid == server_pid:
        return "tritonserver"
    for arg in proc.cmdline():
        if arg.endswith("model.py"):
            return Path(arg).parent.parent.name
    return proc.name()


def cpu_by_process(server_pid: int) -> Counter[str]:
    """User + system CPU seconds so far of the server and each of its descendants, summed by name.
    A process that ends between listing and reading is left out."""
    server = psutil.Process(server_pid)
    out: Counter[str] = Counter()
    for proc in [server, *server.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            out[process_name(proc, server_pid)] += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return out
