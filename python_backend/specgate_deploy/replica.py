"""One full replica: a tritonserver and the OpenAI-compatible front on its own ports.

Started with specgate_launcher's own functions, so a replica is exactly what `make serve` runs. What is
added here is the life cycle around them: restart a tritonserver that died or can no longer serve
(specgate_deploy.health: a dead stub, a model wedged LOADING, an engine that answers no ping, whose
stubs are killed first; a dead spec_engine stub is reloaded instead), and drain on shutdown.

Drain, as measured on the bundled Triton 2.51: on SIGTERM tritonserver closes its HTTP port at once
(readiness probes and HAProxy's health check fail, so no new traffic arrives), lets every request in
flight finish, and exits once they have, or after `--exit-timeout-secs`. Its gRPC port keeps taking
requests until then, so the front, which talks gRPC, is stopped only after tritonserver has exited:
the front's streams in flight end with their last token, not cut by its own shutdown.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import specgate_launcher as launcher
from specgate_deploy import health
from specgate_deploy.state import PortSet, ReplicaRecord, ReplicaStatus

# Seconds a draining tritonserver may take to finish the requests in flight (`--exit-timeout-secs`).
# The longest request the shipped policy lets run: a 1024-token generation at about 10 ms a token on
# these CPUs (docs/loadtest.md), behind up to 30 s in the gate's queue (admission.queue_timeout_s).
DRAIN_S = 60
EXIT_S = 5  # after the drain, tritonserver's own exit
KILL_S = 5  # a server still there (or stopped as unable to serve): SIGINT to its group, SIGKILL after this
FRONT_STOP_S = 10  # the front's own graceful stop, after tritonserver has gone
HEALTH_INTERVAL_S = 5.0  # between two looks at a ready server's models; a fault must be seen twice
LOOK_TIMEOUT_S = 5.0  # one look: the repository index's answer (then the engines' pings, health.PING_TIMEOUT_S)
# A restarted server that dies again before it is ready (a port still taken, a broken file) would die
# the same way at once: the next try waits BACKOFF_S, then twice that, ... up to MAX_BACKOFF_S, and
# after MAX_FAILURES such deaths in a row the replica is given up ("failed"). One that became ready
# was serving: its death is restarted at once, and resets the count.
BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
MAX_FAILURES = 8


def worst_stop_s(drain_s: float) -> float:
    """The longest finish_drain takes after begin_drain: the drain and tritonserver's exit, its kill,
    the front's stop, each waited out in turn (a pod's grace period covers this: pod.worst_stop_s)."""
    return drain_s + EXIT_S + KILL_S + FRONT_STOP_S


def replica_ports(base: int, index: int) -> launcher.Ports:
    """Replica i listens on base + 10 i + (0 HTTP, 1 gRPC, 2 metrics, 3 front)."""
    b = base + 10 * index
    return launcher.Ports(b, b + 1, b + 2, b + 3)


def is_ready(ports: launcher.Ports) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.http}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Replica:
    name: str
    ports: launcher.Ports
    repo: Path
    log_dir: Path
    drain_s: int = DRAIN_S
    admin_header: str = launcher.ADMIN_HEADER
    # how tritonserver starts: the launcher's CPU server, or the tensorrtllm one (pod.py)
    server_factory: Callable[..., subprocess.Popen] = launcher.start
    restart_on_exit: bool = True  # False in a container: its end is the kubelet's to see (pod.py)
    server: subprocess.Popen | None = None
    front: subprocess.Popen | None = None
    status: ReplicaStatus = "stopped"
    restarts: int = 0
    health_interval_s: float = HEALTH_INTERVAL_S
    backoff_s: float = BACKOFF_S
    _failures: int = field(default=0, repr=False)  # runs in a row that died before they were ready
    _restart_at: float | None = field(default=None, repr=False)  # when a restart waiting out its backoff starts
    _started_at: float = field(default=0.0, repr=False)
    _health: health.HealthCheck | None = field(default=None, repr=False)
    _last_look: float = field(default=0.0, repr=False)
    _suspect: health.Fault | None = field(default=None, repr=False)  # what the last look found wrong
    _reloading: threading.Thread | None = field(default=None, repr=False)

    @property
    def server_log(self) -> Path:
        """The running server's log; run N's (N = 1, 2, ...), once a restart replaced it, is `.log.N`
        beside it, and the previous `make serve`'s last `.log.0`."""
        return self.log_dir / f"{self.name}-tritonserver.log"

    @property
    def front_log(self) -> Path:
        return self.log_dir / f"{self.name}-front.log"

    @property
    def failed_to_start(self) -> bool:
        """Its first tritonserver exited before it was ever ready: a broken repository or a port in
        use, which a restart would meet again. Not restarted; the launcher ends with `log_tail()`."""
        return self.status == "starting" and self.server is not None and self.server.poll() is not None

    def log_tail(self, chars: int = 5000) -> str:
        return self.server_log.read_text(errors="replace")[-chars:] if self.server_log.exists() else ""

    def start(self) -> None:
        """Start tritonserver (the front follows once it is ready: `poll()`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.server_log
        if self.restarts == 0:  # numbered logs of an earlier `make serve` would pass for this one's
            for old in log.parent.glob(f"{log.name}.*"):
                old.unlink()
        if log.exists():  # keep the log of the run that ended, for the operator: none is overwritten
            log.replace(log.with_name(f"{log.name}.{self.restarts}"))
        self.server = self.server_factory(self.repo, self.ports, log_file=log, extra=[f"--exit-timeout-secs={self.drain_s}"],
                                          admin_header=self.admin_header)
        self.status = "starting" if self.restarts == 0 else "restarting"
        self._started_at = self._last_look = time.monotonic()
        self._health = health.HealthCheck(health.python_instances(self.repo))
        self._suspect = None

    def poll(self) -> bool:
        """Advance the life cycle by one look; True when something changed (the replicas file is
        rewritten then). A dead tritonserver is restarted, and so is one whose models cannot serve;
        the front, a client that reconnects, stays."""
        if self.server is None or self.status in ("draining", "stopped", "failed"):
            return False
        if self._restart_at is not None:
            if time.monotonic() < self._restart_at:
                return False
            self._start_again()
            return True
        if self.server.poll() is not None:
            if not self.restart_on_exit or self.failed_to_start:
                return False
            print(f"[replicas] {self.name}: tritonserver (pid {self.server.pid}) exited with code {self.server.returncode}; restarting it",
                  flush=True)
            self._restart()
            return True
        if self.front is not None and self.front.poll() is not None:
            print(f"[replicas] {self.name}: the front exited with code {self.front.returncode}; restarting it", flush=True)
            self._start_front()
            return True
        if self.status == "ready":
            return self._look()
        if self.status in ("starting", "restarting") and is_ready(self.ports):
            if self.front is not None:
                # A new front with the new server: the old one's gRPC channel backs off its reconnects
                # (up to minutes) after its server died, and would answer 503 meanwhile. Its own
                # requests ended when the old server died, each with its error sent.
                launcher.stop(self.front, timeout_s=FRONT_STOP_S)
            self._start_front()
            self.status = "ready"
            print(f"[replicas] {self.name}: ready after {time.monotonic() - self._started_at:.0f} s "
                  f"(HTTP :{self.ports.http}, gRPC :{self.ports.grpc}, metrics :{self.ports.metrics}, front :{self.ports.front})",
                  flush=True)
            return True
        return False

    def _restart(self) -> None:
        launcher.stop(self.server, timeout_s=KILL_S)  # and its stubs, which a killed server leaves behind
        if not self.restart_on_exit:  # the server's end is the container's, and the kubelet's to restart
            return
        self._failures = self._failures + 1 if self.status == "restarting" else 0
        if self._failures >= MAX_FAILURES:
            self.status = "failed"
            print(f"[replicas] {self.name}: tritonserver died {self._failures} times in a row before it was ready; giving up "
                  f"(its last log: {self.server_log})", flush=True)
            return
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self._failures - 1)) if self._failures else 0.0
        self.status = "restarting"
        if delay:
            print(f"[replicas] {self.name}: it died before it was ready ({self._failures} of {MAX_FAILURES}); restarting in {delay:g} s",
                  flush=True)
            self._restart_at = time.monotonic() + delay
        else:
            self._start_again()

    def _start_again(self) -> None:
        self._restart_at = None
        self.restarts += 1
        self.start()

    def _look(self) -> bool:
        """Every `health_interval_s`, judge the ready server's models. A fault seen on two looks in a
        row (not a reload caught half-way) has spec_engine reloaded, or the server restarted at once:
        not drained, since the requests on a dead model have failed already, and a drain waits out its
        whole period for the gate's streams to it, which Triton never ends (docs/robustness.md)."""
        now = time.monotonic()
        if now - self._last_look < self.health_interval_s:
            return False
        self._last_look = now
        headers = launcher.admin_headers(self.admin_header)
        index = health.repository_index(self.ports.http, headers, LOOK_TIMEOUT_S)
        fault = None if index is None else self._health.verdict(index, health.live_stubs(self.server.pid), now) or self._hung(index)
        seen_before, self._suspect = self._suspect, fault
        if fault is None or seen_before is None:
            return False
        if fault.hung:  # killed, its stubs are dead ones, reloaded or restarted as any
            print(f"[replicas] {self.name}: {fault.reason}; killing its stub processes", flush=True)
            health.kill_stubs(self.server.pid, fault.model)
        if fault.model in health.RELOADABLE and not fault.wedged:
            if self._reloading is None or not self._reloading.is_alive():
                print(f"[replicas] {self.name}: {fault.reason}; reloading it (meanwhile the baseline serves)", flush=True)
                self._reloading = threading.Thread(target=self._reload, args=(fault.model, headers), name=f"reload-{fault.model}",
                                                   daemon=True)
                self._reloading.start()
            return False
        print(f"[replicas] {self.name}: {fault.reason}; {'restarting' if self.restart_on_exit else 'stopping'} tritonserver", flush=True)
        self._restart()
        return True

    def _hung(self, index: list[health.ModelState]) -> health.Fault | None:
        """A READY model of this server (the gate or an engine) whose stubs answer no ping (not one being reloaded)."""
        reloading = self._reloading is not None and self._reloading.is_alive()
        pinged = [m.name for m in index if m.state == "READY" and m.name in health.PINGED and m.name in self._health.expected_stubs
                  and not (reloading and m.name in health.RELOADABLE)]
        hung = health.unanswered_pings(self.ports.grpc, pinged, launcher.engine_key()) if pinged else []
        return health.Fault(model=hung[0], reason=f"{hung[0]} answers no ping", hung=True) if hung else None

    def _reload(self, model: str, headers: dict[str, str]) -> None:
        """In a thread: a load takes seconds to minutes, and the supervisor keeps looking meanwhile (a
        load that wedges is then a restart)."""
        try:
            health.reload_model(self.ports.http, headers, model)
            print(f"[replicas] {self.name}: {model} reloaded", flush=True)
        except OSError as e:  # it stays unloaded, and the baseline serves; the operator reads why
            print(f"[replicas] {self.name}: reloading {model} failed: {e}", flush=True)

    def _start_front(self) -> None:
        self.front = launcher.start_front(self.ports, self.front_log)

    def begin_drain(self) -> None:
        """SIGTERM to tritonserver alone (not its process group: its stubs serve the requests in flight)."""
        self.status = "draining"
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)

    def finish_drain(self, deadline: float) -> None:
        """Wait for tritonserver until `deadline` (monotonic), then stop the front and everything left."""
        if self.server is not None:
            try:
                self.server.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[replicas] {self.name}: requests still running after the drain period; stopping them", flush=True)
            launcher.stop(self.server, timeout_s=KILL_S)
        if self.front is not None:
            launcher.stop(self.front, timeout_s=FRONT_STOP_S)
        self.status = "stopped"

    def record(self) -> ReplicaRecord:
        alive = lambda p: p.pid if p is not None and p.poll() is None else None  # noqa: E731
        return ReplicaRecord(name=self.name, ports=PortSet(**vars(self.ports)), tritonserver_pid=alive(self.server),
                             front_pid=alive(self.front), status=self.status, restarts=self.restarts)


def drain_all(replicas: list[Replica], drain_s: float) -> None:
    """Drain every replica at once: all stop taking traffic together, then each finishes its requests."""
    deadline = time.monotonic() + drain_s + EXIT_S
    for r in replicas:
        r.begin_drain()
    for r in replicas:
        r.finish_drain(deadline)

