"""A Python-backend stub ends itself when the tritonserver that started it dies.

Seen: a tritonserver killed with SIGKILL (or by the kernel) left all six stubs running for minutes,
holding their memory and, through the engines, the machine's cores. The stub's own check of its
parent did not notice: it looks at the parent pid, which an unreaped zombie keeps. The parent's
death does change this process's parent id at once (the kernel hands orphans to init or a
subreaper), so a thread compares it every CHECK_S and exits the process when it changes.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

CHECK_S = 1.0
_started = False
_lock = threading.Lock()


def watch_parent(check_s: float = CHECK_S) -> None:
    """Start the watchdog (once per process): exit when the parent process changes."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(check_s)
        log.error("tritonserver (pid %d) is gone: this stub exits", parent)
        os._exit(1)  # no cleanup to wait for: nothing is left to answer

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
