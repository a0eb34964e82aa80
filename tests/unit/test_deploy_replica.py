"""The replica supervisor's life cycle (specgate_deploy.replica) around a stand-in server process: a
server that never became ready is not restarted; a ready one found unable to serve on two looks in a
row is restarted, or has spec_engine reloaded. With the real tritonserver: tests/integration/test_orphans.py."""

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


@pytest.fixture
def looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, list[str]]:
    """A ready server's looks, stubbed: both engines READY with the stubs left in the Counter; the
    repository calls a reload makes are recorded."""
    for model in ("target_engine", "spec_engine"):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\nbackend: "python"\n')
    stubs = Counter(target_engine=1, spec_engine=1)
    reloads: list[str] = []
    monkeypatch.setattr(health, "repository_index", lambda *_: [ModelState(name=m, state="READY") for m in ("target_engine", "spec_engine")])
    monkeypatch.setattr(health, "live_stubs", lambda pid: stubs)
    monkeypatch.setattr(health, "reload_model", lambda port, headers, model: reloads.append(model))
    monkeypatch.setattr(launcher, "admin_headers", lambda header: {})
    monkeypatch.setattr(launcher, "start_front", lambda ports, log: subprocess.Popen(["sleep", "60"]))
    return stubs, reloads


def _ready(tmp_path: Path) -> tuple[Replica, list[subprocess.Popen]]:
    r, started = _replica(tmp_path, "trap '' INT TERM; sleep 60")  # a server slow to stop: it is killed
    r.start()
    r.status = "ready"  # as if it had answered /v2/health/ready
    return r, started


def _end(r: Replica, started: list[subprocess.Popen]) -> None:
    for p in started + [r.front]:
        if p is not None:
            p.kill()
            p.wait()


def test_a_ready_server_with_a_dead_engine_stub_is_restarted_at_once(tmp_path: Path, looks) -> None:
    stubs, reloads = looks
    r, started = _ready(tmp_path)
    try:
        assert not r.poll() and not r.poll()  # healthy: nothing happens
        del stubs["target_engine"]  # its stub died
        assert not r.poll()  # seen once: could be a reload caught half-way
        t0 = time.monotonic()
        assert r.poll()  # seen twice: restarted, without waiting out a drain
        assert time.monotonic() - t0 < 10 and started[0].poll() is not None
        assert r.restarts == 1 and len(started) == 2 and r.server is started[1] and r.status == "restarting"
        assert not r.failed_to_start and not reloads  # a restart that fails is retried: the server did serve before
    finally:
        _end(r, started)


def test_a_dead_spec_engine_stub_is_reloaded_and_the_server_kept(tmp_path: Path, looks) -> None:
    stubs, reloads = looks
    r, started = _ready(tmp_path)
    try:
        del stubs["spec_engine"]
        assert not r.poll() and not r.poll()
        r._reloading.join(10)
        assert reloads == ["spec_engine"] and r.restarts == 0 and started[0].poll() is None and r.status == "ready"
    finally:
        _end(r, started)


def test_in_a_container_a_server_that_cannot_serve_is_stopped_for_the_kubelet(tmp_path: Path, looks) -> None:
    stubs, _ = looks
    r, started = _ready(tmp_path)
    r.restart_on_exit = False
    try:
        del stubs["target_engine"]
        r.poll()
        r.poll()
        assert started[0].poll() is not None and len(started) == 1 and r.restarts == 0
    finally:
        _end(r, started)


def test_a_stop_takes_all_of_worst_stop_s_at_the_longest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server and a front that ignore SIGTERM and SIGINT (a request that outlives the drain, a front
    that hangs) make finish_drain wait out every one of its waits: worst_stop_s must be their sum, which
    the pod's grace period is computed from (test_deploy_k8s). The same code, with shortened waits."""
    from specgate_deploy import replica as replica_mod

    for name in ("EXIT_S", "KILL_S", "FRONT_STOP_S"):
        monkeypatch.setattr(replica_mod, name, 0.4)
    r, started = _replica(tmp_path, "trap '' INT TERM; sleep 60")
    r.drain_s = 1
    r.start()
    r.front = subprocess.Popen(["sh", "-c", "trap '' INT TERM; sleep 60"], start_new_session=True)
    t0 = time.monotonic()
    r.begin_drain()
    r.finish_drain(t0 + r.drain_s + replica_mod.EXIT_S)
    took, worst = time.monotonic() - t0, replica_mod.worst_stop_s(r.drain_s)
    assert worst - 0.3 < took < worst + 0.5, (took, worst)
    assert r.server.poll() is not None and r.front.poll() is not None and r.status == "stopped"
