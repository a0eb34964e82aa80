"""One engine at a time runs a decode on the machine's cores.

llama.cpp's threads synchronise with spinning barriers many times per decode. Two engine processes
decoding at once on the same cores (a shadow mirror beside the request it mirrors, a request
handed over, both routes busy) keep preempting each other inside those barriers: a generation that
took 1 s alone took over 10 s. Taking turns per decode costs each a wait of at most one step of the
other, and two uncontended system calls when alone.

The lock is an flock on a file shared by every engine of the machine (`SPECGATE_COMPUTE_LOCK`, set
by the launcher); without it (an engine used in-process) there is nothing to share with.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

ENV = "SPECGATE_COMPUTE_LOCK"


class ComputeLock(AbstractContextManager):
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> "ComputeLock":
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # releases the GIL while it waits
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


def compute_lock() -> AbstractContextManager:
    path = os.environ.get(ENV)
    return ComputeLock(Path(path)) if path else nullcontext()
