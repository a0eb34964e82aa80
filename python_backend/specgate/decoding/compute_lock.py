"""One engine at a time runs a decode on the machine's cores.

llama.cpp's threads synchronise with spinning barriers many times per decode. Two engine processes
decoding at once on the same cores (a shadow mirror beside the request it mirrors, a request
handed over, both routes busy) keep preempting each other inside those barriers: a generation that
took 1 s alone took over 10 s. Taking turns per decode costs each a wait of at most one step of the
other, and two uncontended system calls when alone.

The lock is an flock on a file shared by the engines of one checkout (`SPECGATE_COMPUTE_LOCK`, set
by the launcher to a file under artifacts/); without it (an engine used in-process) there is nothing
to share with. It only makes decodes faster, so nothing may stall on it (issue 49: the lock was a
fixed file in /tmp, which another local user could hold to hang every engine while their pings
still answered):

- a lock file that another user owns is refused at start (its directory is made 0700);
- a turn not had within `STALL_S` is a stall: the engine logs it, with the holder's pid, and decodes
  without taking turns until its wait for the turn ends. Held longer than a decode, the turn is held
  by a process that is stuck (or, in the tests that slow the engines, on purpose: they hold it for a
  few seconds), so waiting on is worse than decoding beside it.
"""

from __future__ import annotations

import fcntl
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitTimeout
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SPECGATE_COMPUTE_LOCK"
STALL_S = 30.0  # a decode takes milliseconds; the soak and test_gate_failover hold the turn up to 15 s


class ComputeLock(AbstractContextManager):
    def __init__(self, path: Path, stall_s: float = STALL_S) -> None:
        self.path, self.stall_s = path, stall_s
        self._fd = _open_own(path)
        self._held = False
        # An uncontended turn is one non-blocking flock on the decode thread. A contended one blocks
        # in this thread instead, so that the decode thread can stop waiting for it.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute-lock")
        self._stalled: Future | None = None  # a wait for the turn that outlived stall_s

    def __enter__(self) -> "ComputeLock":
        self._held = self._take_turn()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    def _take_turn(self) -> bool:
        """Whether this decode holds the turn (False: it decodes beside a stalled holder)."""
        if self._stalled is not None:
            if not self._stalled.done():
                return False
            self._stalled = None
            log.warning("compute lock %s: the stall is over, taking turns again", self.path)
            return True  # the stalled wait got the turn at last
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        wait = self._waiter.submit(fcntl.flock, self._fd, fcntl.LOCK_EX)  # releases the GIL while it waits
        try:
            wait.result(timeout=self.stall_s)
            return True
        except WaitTimeout:
            self._stalled = wait
            log.error(
                "compute lock %s: no turn within %.0f s (held by pid %s); decoding without taking turns until it is free",
                self.path, self.stall_s, holder(self._fd) or "?",
            )
            return False


def _open_own(path: Path) -> int:
    """The lock file, created 0600 in a 0700 directory if new; PermissionError if another user owns it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise PermissionError(
            f"compute lock {path} belongs to uid {owner}, not this user ({os.geteuid()}): its holder could stall every engine; "
            f"remove it, or point {ENV} at a file of your own"
        )
    return fd


def holder(fd: int) -> int | None:
    """The pid holding the flock on `fd`'s file, from /proc/locks (None where it cannot tell)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:  # a waiter's line has "->" at [1]
            return int(fields[4])
    return None


def compute_lock() -> AbstractContextManager:
    path = os.environ.get(ENV)
    return ComputeLock(Path(path)) if path else nullcontext()
