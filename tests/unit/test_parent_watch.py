"""serving/parent_watch: a stub ends when its tritonserver dies, also while that server is an
unreaped zombie (issue 26), and whatever the stub's Python threads are doing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The child stands for a stub: it starts the watcher, then holds the GIL (a long C call that never lets
# another thread in, as spec_engine's calibration kept a watchdog thread out for over 10 s).
CHILD = f"""
import sys
sys.path[:0] = [{str(ROOT / 'python_backend')!r}]
from specgate.serving.parent_watch import watch_parent
watch_parent()
print("watching", flush=True)
while True:
    sum(range(10**10))
"""
# The parent stands for tritonserver: it starts the child, says its pid, and waits.
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_a_process_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        os.kill(parent.pid, signal.SIGKILL)  # not reaped until the end: a zombie, as a crashed server is
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child), "the child outlived its parent"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)
        parent.wait()


def test_the_watcher_ends_with_its_process() -> None:
    """A stub that ends normally (its model unloaded) leaves no watcher behind."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.replace("while True:\n    sum(range(10**10))", "")], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "watching"
    child.wait(timeout=60)
    out = subprocess.run(["pgrep", "-f", f"specgate-parent-watch {child.pid} "], capture_output=True, text=True).stdout
    deadline = time.monotonic() + 10
    while out.strip() and time.monotonic() < deadline:
        time.sleep(0.2)
        out = subprocess.run(["pgrep", "-f", f"specgate-parent-watch {child.pid} "], capture_output=True, text=True).stdout
    assert not out.strip(), "the watcher outlived its process"
