"""A Python-backend stub ends when the tritonserver that started it dies.

Seen: a tritonserver killed with SIGKILL (or by the kernel) left all six stubs running for minutes,
holding their memory and, through the engines, the machine's cores. The stub's own check of its
parent did not notice: it looks at the parent pid, which an unreaped zombie keeps. The parent's
death does change the stub's parent id at once (the kernel hands orphans to init or a subreaper).

The check runs in a tiny shell process beside the stub, not in a Python thread: a thread of the stub
needs the GIL, and seen in test_orphans.py, spec_engine's calibration kept a watchdog thread from
running for longer than the 10 s the stub may outlive its server. The shell reads the stub's parent
from /proc every CHECK_S and kills the stub when it changes; it ends when the stub ends.
"""

from __future__ import annotations

import os
import subprocess

CHECK_S = 1
# $1: the stub's pid, $2: its parent's. /proc/<pid>/stat reads "pid (comm) state ppid ...", and the
# stub's comm (triton_python_backend_stub, cut to 15 characters) holds no space.
_WATCH = f"""
while :; do
  read -r _ _ _ ppid _ < /proc/$1/stat 2>/dev/null || exit 0
  [ "$ppid" = "$2" ] || exec kill -9 "$1"
  sleep {CHECK_S}
done
"""
_watcher: subprocess.Popen | None = None


def watch_parent() -> None:
    """Start the watcher for this process (once): it is killed when its parent process changes."""
    global _watcher
    if _watcher is None:
        _watcher = subprocess.Popen(
            ["/bin/sh", "-c", _WATCH, "specgate-parent-watch", str(os.getpid()), str(os.getppid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        )
