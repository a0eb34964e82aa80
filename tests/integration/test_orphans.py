"""Issue 26, item 6: nothing of ours outlives the process that started it.

Seen: a `make serve` killed with SIGKILL, or hung up by a closed terminal, left tritonserver, its
stubs and the OpenAI front serving for minutes, holding the ports; and a stub does not notice that
tritonserver died (the backend's own check of its parent passes while the parent is an unreaped
zombie). Each test starts a server of its own, on its own rendered repository (so that its stubs are
never confused with the session server's), and kills it. And a tritonserver that dies under
`make serve` is replaced, not left dead (Triton 2.51 can abort when a stub dies), and so is one that
lost target_engine's stub; a dead spec_engine stub is reloaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from specgate.decoding.compute_lock import ENV as ENV_COMPUTE_LOCK
from specgate_launcher import Ports, start, stop, wait_ready
from tests.conftest import PINNED_DRAFTING, ROOT, TEST_OUT
from tests.integration.conftest import free_port

OUT = TEST_OUT.parent / "test-orphans"
GONE_WITHIN_S = 10  # the bound for a SIGKILL; a graceful stop may take its exit timeout


@pytest.fixture(scope="module")
def repository(checkpoint: Path) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ("policy.yaml", "tenants.yaml"):
        shutil.copy(ROOT / "tests" / "integration" / name, OUT / name)
    subprocess.run(
        [sys.executable, "-m", "build.build_engines", "--dtype", "float32", "--out-dir", str(OUT), "--policy", str(OUT / "policy.yaml"),
         "--calibration-override", PINNED_DRAFTING],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )
    return OUT / "model_repository"


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it just ended
                continue
            out[int(entry.name)] = (int(fields[1]), fields[0])
    return out


def _descendants(pid: int) -> set[int]:
    procs, found, todo = _processes(), set(), [pid]
    while todo:
        parent = todo.pop()
        children = {p for p, (pp, _) in procs.items() if pp == parent} - found
        found |= children
        todo += children
    return found


def _alive(pids: set[int]) -> set[int]:
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][1] not in "ZX"}  # a zombie has ended


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_all(pids: set[int]) -> None:
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


STUBS = 5  # Python-backend stubs a server runs: preprocessing (2 instances), spec_gate, target_engine, spec_engine


def _ports() -> Ports:
    return Ports(free_port(), free_port(), free_port(), free_port())


def _start_launcher(repository: Path, log: Path) -> tuple[subprocess.Popen, Ports]:
    """`make serve`'s launcher on free ports, ready."""
    ports = _ports()
    env = {**os.environ, ENV_COMPUTE_LOCK: str(OUT / "compute.lock")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python_backend"), str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "specgate_deploy.serve", "--model-repository", str(repository), "--http-port", str(ports.http),
           "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics), "--front-port", str(ports.front),
           "--log-dir", str(OUT / "logs")]  # fmt: skip
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    _wait_log(launcher, log, "[serve] ready")
    return launcher, ports


def _wait_log(launcher: subprocess.Popen, log: Path, line: str, count: int = 1, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while log.read_text().count(line) < count:
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _ours(launcher: subprocess.Popen) -> tuple[set[int], list[str]]:
    ours = _descendants(launcher.pid)
    kinds = [_cmdline(p) for p in ours]
    assert sum("tritonserver " in k for k in kinds) == 1 and sum("specgate_front" in k for k in kinds) == 1, kinds
    assert sum("triton_python_backend_stub" in k for k in kinds) >= STUBS, kinds
    return ours, kinds


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def _end(launcher: subprocess.Popen, ours: set[int]) -> None:
    _kill_all(ours | _descendants(launcher.pid))
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("sig, within_s", [(signal.SIGKILL, GONE_WITHIN_S), (signal.SIGHUP, 60)], ids=["SIGKILL", "SIGHUP"])
def test_a_launcher_that_dies_takes_the_server_stubs_and_front_with_it(repository: Path, sig: int, within_s: float) -> None:
    launcher, _ = _start_launcher(repository, OUT / "launcher.log")
    ours: set[int] = set()
    try:
        ours, _ = _ours(launcher)
        os.kill(launcher.pid, sig)
        launcher.wait(timeout=120)
        left = _wait_gone(ours, within_s)
        print(f"\n{signal.Signals(sig).name} to the launcher: {len(ours)} processes of ours, {len(left)} left after {within_s} s")
        assert not left, [_cmdline(p) for p in left]
    finally:
        _end(launcher, ours)


def _serves_then_stops_cleanly(launcher: subprocess.Popen, ports: Ports, ours: set[int], what: str) -> None:
    """The front answers a chat completion, and SIGTERM to the launcher then leaves nothing of ours."""
    body = {"model": "llm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    r = requests.post(f"http://127.0.0.1:{ports.front}/v1/chat/completions", json=body, timeout=120)
    print(f"\n{what}; the front answered HTTP {r.status_code}")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    os.kill(launcher.pid, signal.SIGTERM)
    launcher.wait(timeout=120)
    left = _wait_gone(ours, GONE_WITHIN_S)
    assert not left, [_cmdline(p) for p in left]


# what is hit (a word of its command line), how, and what the launcher says of it (None: its exit):
# as Triton's abort does; as an OOM kill does; a stub that hangs alive (issue 49: its model stayed
# READY with its process count whole, and the launcher saw nothing)
FAULTS = {
    "server-aborted": ("tritonserver ", signal.SIGABRT, None),
    "target-engine-stub-killed": ("/target_engine/1/model.py", signal.SIGKILL, "target_engine is READY but 1 of its 1 stub processes died"),
    "target-engine-stub-hung": ("/target_engine/1/model.py", signal.SIGSTOP, "target_engine answers no ping"),
    # as Triton's lock-order hang leaves the gate (docs/robustness.md "Limits"): every request hangs
    "spec-gate-stub-hung": ("/spec_gate/1/model.py", signal.SIGSTOP, "spec_gate answers no ping"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_launcher_restarts_a_tritonserver_that_died_or_cannot_serve(repository: Path, fault: str) -> None:
    """Triton 2.51's Python backend can abort the whole server when a stub dies (docs/robustness.md,
    "Limits"); and when an engine's stub dies alone, or hangs alive, the server stays up and ready but
    never starts a new one, so every request to it fails. Either way `make serve` must come back by itself, front
    included, and still stop cleanly."""
    victim, sig, said = FAULTS[fault]
    log = OUT / f"launcher-{fault}.log"
    launcher, ports = _start_launcher(repository, log)
    ours: set[int] = set()
    try:
        ours, kinds = _ours(launcher)
        (server,) = [p for p, k in zip(ours, kinds) if "tritonserver " in k]
        (pid,) = [p for p, k in zip(ours, kinds) if victim in k]
        os.kill(pid, sig)
        started = time.monotonic()
        _wait_log(launcher, log, "ready after", count=2, timeout_s=600)
        restarted_s = time.monotonic() - started
        if said is not None:
            assert said in log.read_text(), log.read_text()[-3000:]
        ours |= _descendants(launcher.pid)
        _ours(launcher)  # one tritonserver, one front again: the old ones are gone
        assert server not in _alive(ours)
        deadline = time.monotonic() + 120  # the new front starts once the new server is ready
        while not _answers(f"http://127.0.0.1:{ports.front}/v1/models") and time.monotonic() < deadline:
            time.sleep(0.5)
        _serves_then_stops_cleanly(launcher, ports, ours, f"{fault}: serving again after {restarted_s:.0f} s")
    finally:
        _end(launcher, ours)


def test_the_launcher_reloads_a_dead_spec_engine_and_keeps_the_server(repository: Path) -> None:
    """The server serves without spec_engine (on the baseline), so its dead stub is reloaded through
    the repository API, not the server restarted."""
    log = OUT / "launcher-spec-engine-stub-killed.log"
    launcher, ports = _start_launcher(repository, log)
    ours: set[int] = set()
    try:
        ours, kinds = _ours(launcher)
        (server,) = [p for p, k in zip(ours, kinds) if "tritonserver " in k]
        (stub,) = [p for p, k in zip(ours, kinds) if "/spec_engine/1/model.py" in k]
        os.kill(stub, signal.SIGKILL)
        started = time.monotonic()
        _wait_log(launcher, log, "spec_engine reloaded", timeout_s=600)
        reloaded_s = time.monotonic() - started
        ours |= _descendants(launcher.pid)
        (new_stub,) = [p for p in _alive(ours) if "/spec_engine/1/model.py" in _cmdline(p)]
        assert server in _alive(ours) and new_stub != stub and log.read_text().count("ready after") == 1
        _serves_then_stops_cleanly(launcher, ports, ours, f"spec_engine's stub killed: reloaded after {reloaded_s:.0f} s, same server")
    finally:
        _end(launcher, ours)


def test_stubs_end_when_tritonserver_is_killed(repository: Path) -> None:
    """tritonserver killed with SIGKILL and left unreaped (its parent does not wait for it, as a
    launcher that is itself gone cannot): every stub must end within GONE_WITHIN_S."""
    ports = _ports()
    os.environ.setdefault(ENV_COMPUTE_LOCK, str(OUT / "compute.lock"))
    server = start(repository, ports, log_file=OUT / "tritonserver.log")
    stubs: set[int] = set()
    try:
        wait_ready(server, ports)
        stubs = _descendants(server.pid)
        assert sum("triton_python_backend_stub" in _cmdline(p) for p in stubs) >= STUBS
        os.kill(server.pid, signal.SIGKILL)  # not reaped until the end of the test: a zombie
        left = _wait_gone(stubs, GONE_WITHIN_S)
        print(f"\ntritonserver killed: {len(stubs)} stubs, {len(left)} left after {GONE_WITHIN_S} s")
        assert not left, [_cmdline(p) for p in left]
    finally:
        _kill_all(stubs)
        stop(server)
