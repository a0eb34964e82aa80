"""The replica supervisor's life cycle (specgate_deploy.replica) around a stand-in server process: a
server that never became ready is not restarted; a ready one found unable to serve on two looks in a
row is drained (SIGTERM) and started again. With the real tritonserver: tests/integration/test_orphans.py."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import specgate_launcher as launcher
from specgate_deploy import health
from specgate_deploy.health import ModelState
from specgate_deploy.replica import Replica

PORTS = launcher.Ports(1, 2, 3, 4)  # never contacted: the looks below are stubbed


def _replica(tmp_path: Path, script: str) -> tuple[Replica, list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def factory(repo: Path, ports: launcher.Ports, log_file: Path, extra: list[str], admin_header: str) -> subprocess.Popen:
        with open(log_file, "w") as out:
            started.append(subprocess.Popen(["sh", "-c", script], stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        return started[-1]

    return Replica("r", PORTS, tmp_path, tmp_path / "logs", drain_s=5, server_factory=factory, health_interval_s=0.0), started


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_server_that_never_became_ready_is_not_restarted(tmp_path: Path) -> None:
    r, started = _replica(tmp_path, "echo 'E0101 failed to load model: broken config'; exit 3")
    r.start()
    _until(lambda: r.server.poll() is not None)
    assert not r.poll() and r.failed_to_start and len(started) == 1 and r.restarts == 0
    assert "broken config" in r.log_tail()


def test_a_ready_server_with_a_dead_stub_is_drained_and_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "target_engine").mkdir()
    (tmp_path / "target_engine" / "config.pbtxt").write_text('name: "target_engine"\nbackend: "python"\n')
    stubs = Counter(target_engine=1)
    monkeypatch.setattr(health, "repository_index", lambda *_: [ModelState(name="target_engine", state="READY")])
    monkeypatch.setattr(health, "live_stubs", lambda pid: stubs)
    monkeypatch.setattr(launcher, "admin_headers", lambda header: {})
    monkeypatch.setattr(launcher, "start_front", lambda ports, log: subprocess.Popen(["sleep", "60"]))
    r, started = _replica(tmp_path, "exec sleep 60")  # SIGTERM ends it, as it ends a draining tritonserver
    r.start()
    r.status = "ready"  # as if it had answered /v2/health/ready
    try:
        assert not r.poll() and not r.poll()  # healthy: nothing happens
        del stubs["target_engine"]  # its stub died
        assert not r.poll()  # seen once: could be a reload caught half-way
        assert r.poll() and r.status == "restarting"  # seen twice: drained for a restart
        _until(lambda: started[0].poll() is not None)
        assert started[0].returncode == -15  # SIGTERM, not a kill
        assert r.poll() and r.restarts == 1 and len(started) == 2 and r.server is started[1]
        assert not r.failed_to_start  # a restart that fails is retried: the server did serve before
    finally:
        for p in started + [r.front]:
            if p is not None:
                p.kill()
                p.wait()


def test_a_server_that_ignores_the_drain_is_killed(tmp_path: Path) -> None:
    r, started = _replica(tmp_path, "trap '' TERM; exec sleep 60")
    r.start()
    r._stop_by = time.monotonic() - 1  # drained for a restart, past its deadline
    try:
        assert not r.poll()
        assert started[0].poll() is not None  # killed with its process group
    finally:
        for p in started:
            p.kill()
            p.wait()
