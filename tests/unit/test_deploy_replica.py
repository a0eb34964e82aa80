"""The replica supervisor's life cycle (specgate_deploy.replica) around a stand-in server process: a
server that never became ready is not restarted; a ready one found unable to serve on two looks in a
row is restarted, or has spec_engine reloaded. With the real tritonserver: tests/integration/test_orphans.py."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
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


@dataclass
class Looks:
    stubs: Counter  # live stubs per model
    reloads: list[str] = field(default_factory=list)  # models reloaded
    hung: set[str] = field(default_factory=set)  # engines that answer no ping
    killed: list[str] = field(default_factory=list)  # models whose stubs were killed


@pytest.fixture
def looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Looks:
    """A ready server's looks, stubbed: both engines READY with the stubs left in `stubs`, answering
    pings but for those in `hung`; the reloads and stub kills the supervisor makes are recorded."""
    for model in ("target_engine", "spec_engine"):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(f'name: "{model}"\nbackend: "python"\n')
    looks = Looks(Counter(target_engine=1, spec_engine=1))
    monkeypatch.setattr(health, "repository_index",
                        lambda *_: [ModelState(name=m, state="READY") for m in ("target_engine", "spec_engine")])
    monkeypatch.setattr(health, "live_stubs", lambda pid: looks.stubs)
    monkeypatch.setattr(health, "reload_model", lambda port, headers, model: looks.reloads.append(model))
    monkeypatch.setattr(health, "unanswered_pings", lambda port, engines, key: [e for e in engines if e in looks.hung], raising=False)
    monkeypatch.setattr(health, "kill_stubs", lambda pid, model: looks.killed.append(model), raising=False)
    monkeypatch.setattr(launcher, "admin_headers", lambda header: {})
    monkeypatch.setattr(launcher, "engine_key", lambda: "k", raising=False)
    monkeypatch.setattr(launcher, "start_front", lambda ports, log: subprocess.Popen(["sleep", "60"]))
    return looks


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


def test_a_ready_server_with_a_dead_engine_stub_is_restarted_at_once(tmp_path: Path, looks: Looks) -> None:
    stubs, reloads = looks.stubs, looks.reloads
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


def test_a_dead_spec_engine_stub_is_reloaded_and_the_server_kept(tmp_path: Path, looks: Looks) -> None:
    stubs, reloads = looks.stubs, looks.reloads
    r, started = _ready(tmp_path)
    try:
        del stubs["spec_engine"]
        assert not r.poll() and not r.poll()
        r._reloading.join(10)
        assert reloads == ["spec_engine"] and r.restarts == 0 and started[0].poll() is None and r.status == "ready"
    finally:
        _end(r, started)


def test_in_a_container_a_server_that_cannot_serve_is_stopped_for_the_kubelet(tmp_path: Path, looks: Looks) -> None:
    stubs = looks.stubs
    r, started = _ready(tmp_path)
    r.restart_on_exit = False
    try:
        del stubs["target_engine"]
        r.poll()
        r.poll()
        assert started[0].poll() is not None and len(started) == 1 and r.restarts == 0
    finally:
        _end(r, started)




@pytest.mark.parametrize("engine", ["target_engine", "spec_engine"])
def test_an_engine_that_answers_no_ping_has_its_stubs_killed_then_is_restarted_or_reloaded(
    tmp_path: Path, looks: Looks, engine: str
) -> None:
    """Issue 49: a hung stub (alive, answering nothing) kept its model READY and its process count
    whole, so the supervisor saw nothing, and every request to it failed after two ping timeouts."""
    r, started = _ready(tmp_path)
    try:
        assert not r.poll() and not r.poll() and not looks.killed  # answering: nothing happens
        looks.hung.add(engine)
        assert not r.poll() and not looks.killed  # seen once
        r.poll()  # seen twice: its stubs killed, and then as for a dead stub
        assert looks.killed == [engine]
        if engine == "target_engine":
            assert r.restarts == 1 and started[0].poll() is not None
        else:
            r._reloading.join(10)
            assert looks.reloads == ["spec_engine"] and r.restarts == 0 and started[0].poll() is None
    finally:
        _end(r, started)

def test_a_server_that_keeps_dying_before_it_is_ready_backs_off_then_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49: a restart that failed was tried again every second, for ever, and each try overwrote
    the log of the run before (the first crash's among them). Now each run keeps its numbered log,
    the tries back off (1, 2, 4, ... times backoff_s), and the replica is given up after MAX_FAILURES."""
    from specgate_deploy import replica as replica_module

    monkeypatch.setattr(replica_module, "MAX_FAILURES", 3, raising=False)
    # a run alive at a poll is looked at over HTTP with the admin key: none here (no server ever ran)
    monkeypatch.setattr(replica_module.launcher, "admin_headers", lambda *args, **kwargs: {})
    r, started = _replica(tmp_path, 'echo "run $$"; exit 1')
    r.backoff_s = 0.2
    r.start()
    r.status = "ready"  # it served; then it dies, and so does every restart, before it is ready
    runs_at: list[float] = []
    deadline = time.monotonic() + 30
    while r.status != "failed":
        runs = len(started)
        r.poll()
        if len(started) > runs:
            runs_at.append(time.monotonic())
        assert time.monotonic() < deadline and len(started) <= 10, (len(started), r.status)
        time.sleep(0.01)
    # the first run, restarted at once; then two that died before ready, each waiting longer
    assert len(started) == 4 and r.restarts == 3, (len(started), r.restarts)
    gaps = [b - a for a, b in zip(runs_at, runs_at[1:])]
    assert [round(g / 0.2) for g in gaps] == [1, 2], gaps
    r.poll()
    assert len(started) == 4  # given up: no more tries
    logs = [(tmp_path / "logs" / f"r-tritonserver.log.{n}").read_text() for n in (1, 2, 3)] + [r.server_log.read_text()]
    assert all(log.startswith("run ") for log in logs) and len(set(logs)) == 4  # four runs, four logs: none overwritten
    _end(r, started)


def test_a_stop_takes_all_of_worst_stop_s_at_the_longest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server and a front that ignore SIGTERM and SIGINT (a request that outlives the drain, a front
    that hangs) make finish_drain wait out every one of its waits: worst_stop_s must be their sum, which
    the pod's grace period is computed from (test_deploy_k8s). The same code, with shortened waits."""
    from specgate_deploy import replica as replica_mod

    for name in ("EXIT_S", "KILL_S", "FRONT_STOP_S"):
        monkeypatch.setattr(replica_mod, name, 0.4)
    stubborn = "trap '' INT TERM; echo trapped; sleep 60"
    r, started = _replica(tmp_path, stubborn)
    r.drain_s = 1
    r.start()
    r.front = subprocess.Popen(["sh", "-c", stubborn], stdout=subprocess.PIPE, start_new_session=True)
    assert r.front.stdout.readline() == b"trapped\n"
    _until(lambda: "trapped" in r.log_tail())  # a signal before its trap would end it at once
    t0 = time.monotonic()
    r.begin_drain()
    r.finish_drain(t0 + r.drain_s + replica_mod.EXIT_S)
    took, worst = time.monotonic() - t0, replica_mod.worst_stop_s(r.drain_s)
    assert worst - 0.3 < took < worst + 0.5, (took, worst)
    assert r.server.poll() is not None and r.front.poll() is not None and r.status == "stopped"
