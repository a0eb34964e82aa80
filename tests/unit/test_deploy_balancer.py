"""The replica mode's helper processes (specgate_deploy.balancer) end with the supervisor that started
them, however it ends (issue 49: a SIGKILLed or hung-up supervisor left HAProxy and Prometheus
running, holding the public ports). A stand-in for HAProxy here; the real one: tests/integration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_a_helper_dies_with_the_supervisor_that_was_killed(tmp_path: Path) -> None:
    supervisor = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from specgate_deploy.balancer import _spawn; "
         "print(_spawn(['sleep', '60'], __import__('pathlib').Path(sys.argv[1])).pid, flush=True); time.sleep(60)",
         str(tmp_path / "helper.log")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "python_backend")},
    )
    helper = int(supervisor.stdout.readline())
    try:
        assert _alive(helper)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 10
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(helper), "the helper outlived its supervisor"
    finally:
        if _alive(helper):
            os.kill(helper, signal.SIGKILL)
