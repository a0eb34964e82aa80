"""The replica mode's HAProxy configuration (deploy/local/haproxy.cfg.j2), run by the real HAProxy in
front of two stand-in replicas (small HTTP servers that answer as tritonserver and the front would),
for what a rendered file alone cannot show. Issue 49:

- a 502 (this replica cannot serve it now) is retried on the other replica; a 503 (the gate's
  overload refusal) is not, since a retry would double the traffic of overloaded replicas; and a
  request body larger than HAProxy's default 16 KB buffer is still retried;
- the OpenAI front is health-checked on its own port, so a dead front is taken out of rotation;
- only `llm` and the read-only paths are public: not the other models, not the control APIs.

The whole replica mode, with real servers: tests/integration/test_replicas.py.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from loadtest.metrics import scrape
from specgate_deploy.config import haproxy_config
from specgate_deploy.state import PortSet, PublicPorts, ReplicaRecord
from specgate_deploy.tools import INSTALL_HINT, which
from tests.integration.conftest import free_port

HAPROXY = which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason=f"haproxy missing ({INSTALL_HINT}; .ci/run installs it)")

HEALTH = ("/v2/health/ready", "/v1/models")  # what HAProxy's checks ask, of Triton's port and the front's


@dataclass
class Port:
    """One stand-in listener: answers HEALTH with 200, anything else with `status`; counts the rest."""

    status: int = 200
    health_delay_s: float = 0.0  # before it answers a health check
    delay_s: float = 0.0  # before it answers anything but a health check
    dies: bool = False  # at its first request: stops listening and drops that request unanswered (a killed front)
    hits: Counter = field(default_factory=Counter)
    server: ThreadingHTTPServer | None = None

    def serve(self, port: int) -> None:
        me = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                if self.path not in HEALTH:
                    time.sleep(me.delay_s)
                if me.dies and self.path not in HEALTH:
                    me.server.socket.close()  # new connections are refused from now on
                    # and this one ends with no response, reset as the kernel resets a killed process's
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if self.path in HEALTH:
                    time.sleep(me.health_delay_s)
                status = 200 if self.path in HEALTH else me.status
                if self.path not in HEALTH:
                    me.hits[self.path] += 1
                body = b'{"ok": true}'
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@dataclass
class Balancer:
    public: PublicPorts
    http: list[Port]
    front: list[Port]

    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def servers_up(self, proxy: str) -> set[str]:
        try:
            s = scrape(f"{self.url(self.public.haproxy_stats)}/metrics")
        except requests.ConnectionError:  # HAProxy is still starting
            return set()
        return {dict(lbl)["server"] for (name, lbl), v in s.items()
                if name == "haproxy_server_status" and dict(lbl).get("proxy") == proxy and dict(lbl).get("state") == "UP" and v == 1}

    def wait_up(self, proxy: str, servers: set[str], timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while (up := self.servers_up(proxy)) != servers:
            assert time.monotonic() < deadline, f"{proxy}: up {up}, expected {servers}"
            time.sleep(0.2)


@contextmanager
def _running(tmp_path: Path) -> Iterator[Balancer]:
    records, http, front = [], [Port(), Port()], [Port(), Port()]
    for i in range(2):
        ports = PortSet(http=free_port(), grpc=free_port(), metrics=free_port(), front=free_port())
        http[i].serve(ports.http)
        front[i].serve(ports.front)
        records.append(ReplicaRecord(name=f"replica-{i}", ports=ports, tritonserver_pid=None, front_pid=None, status="ready"))
    public = PublicPorts(http=free_port(), grpc=free_port(), front=free_port(), prometheus=free_port(), haproxy_stats=free_port())
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(records, public, "127.0.0.1"))
    proc = subprocess.Popen([str(HAPROXY), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    b = Balancer(public, http, front)
    try:
        b.wait_up("triton_http", {"replica-0", "replica-1"})
        b.wait_up("openai_front", {"replica-0", "replica-1"})
        yield b
    finally:
        proc.kill()
        proc.wait()
        for p in http + front:
            p.stop()


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[Balancer]:
    """One for the test: it may break a replica."""
    with _running(tmp_path) as b:
        yield b


@pytest.fixture(scope="module")
def untouched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    """One for the module's tests that only send requests."""
    with _running(tmp_path_factory.mktemp("haproxy")) as b:
        yield b


GENERATE = "/v2/models/llm/generate"


@pytest.mark.parametrize("size", [100, 64 * 1024], ids=["small body", "64 KB body"])
def test_a_502_is_retried_on_the_other_replica(balancer: Balancer, size: int) -> None:
    balancer.http[0].status = 502  # this replica cannot serve it; the other can
    body = {"text_input": "x" * size}
    statuses = [requests.post(balancer.url(balancer.public.http) + GENERATE, json=body, timeout=10).status_code for _ in range(8)]
    assert statuses == [200] * 8, statuses
    assert balancer.http[0].hits[GENERATE] >= 1  # some did go there first, and were retried


def test_a_503_is_not_retried(balancer: Balancer) -> None:
    """Overload: the client backs off (Retry-After); another replica is not sent the same request."""
    balancer.http[0].status = 503
    statuses = Counter(requests.post(balancer.url(balancer.public.http) + GENERATE, json={}, timeout=10).status_code for _ in range(8))
    assert statuses[503] == balancer.http[0].hits[GENERATE] >= 1, statuses
    assert statuses[200] == balancer.http[1].hits[GENERATE], statuses


def test_a_dead_front_is_taken_out_of_rotation(balancer: Balancer) -> None:
    balancer.front[0].stop()  # its tritonserver's port still answers
    balancer.wait_up("openai_front", {"replica-1"})
    statuses = [requests.get(balancer.url(balancer.public.front) + "/v1/chat", timeout=10).status_code for _ in range(4)]
    assert statuses == [200] * 4 and balancer.front[1].hits["/v1/chat"] == 4


def test_a_front_killed_mid_request_costs_no_request(balancer: Balancer) -> None:
    """A front killed with requests in flight: HAProxy retries the one it dropped and the ones it then
    refuses on the live front (retry-on empty-response and conn-failure, redispatched)."""
    balancer.front[0].dies = True
    balancer.front[1].delay_s = 0.5  # the live one holds its requests a while: leastconn prefers the dead one
    with ThreadPoolExecutor(4) as ex:
        statuses = list(ex.map(lambda _: requests.post(balancer.url(balancer.public.front) + "/v1/chat", json={}, timeout=10).status_code,
                               range(16)))
    assert statuses == [200] * 16, Counter(statuses)


def test_a_slow_but_live_front_stays_in_rotation(balancer: Balancer) -> None:
    """A front that answers its check in 1.5 s (both cores decoding) is alive: with the other one gone
    it is all there is, and taking it out too would answer every client with HAProxy's 503."""
    balancer.front[1].health_delay_s = 1.5
    balancer.front[0].stop()
    balancer.wait_up("openai_front", {"replica-1"})
    time.sleep(4.0)  # four checks
    assert balancer.servers_up("openai_front") == {"replica-1"}
    assert requests.get(balancer.url(balancer.public.front) + "/v1/chat", timeout=10).status_code == 200


@pytest.mark.parametrize("path, public", [
    ("/v2/health/ready", True), ("/v2", True), ("/v2/models/llm", True), ("/v2/models/llm/versions/1/infer", True),
    (GENERATE, True), ("/v2/models/llm/generate_stream", True),
    ("/v2/models/spec_gate/generate", False), ("/v2/models/target_engine/infer", False), ("/v2/models/preprocessing", False),
    ("/v2/repository/index", False), ("/v2/repository/models/spec_engine/unload", False), ("/v2/logging", False),
    ("/v2/models/llm/stats", False), ("/v2/models/llmx/generate", False),
])
def test_only_llm_and_the_read_only_paths_are_public(untouched: Balancer, path: str, public: bool) -> None:
    before = sum(p.hits[path] for p in untouched.http)
    status = requests.post(untouched.url(untouched.public.http) + path, json={}, timeout=10).status_code
    # HAProxy's own checks ask it too
    reached = sum(p.hits[path] for p in untouched.http) - before if path not in HEALTH else int(status == 200)
    assert (status, reached) == ((200, 1) if public else (403, 0))


@pytest.mark.parametrize("method, public", [("ModelStreamInfer", True), ("ServerReady", True), ("RepositoryIndex", False),
                                            ("RepositoryModelUnload", False), ("SystemSharedMemoryRegister", False)])
def test_over_grpc_only_inference_health_and_metadata_are_public(untouched: Balancer, method: str, public: bool) -> None:
    path = f"/inference.GRPCInferenceService/{method}"
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--http2-prior-knowledge", "-X", "POST",
                          f"{untouched.url(untouched.public.grpc)}{path}"], capture_output=True, text=True, timeout=30)
    # the stand-ins serve no gRPC: a call let through finds no server behind (HAProxy answers 503)
    assert (out.stdout == "403") == (not public), out.stdout


def test_a_body_past_the_front_s_limit_is_refused_at_the_door(untouched: Balancer) -> None:
    big = b"x" * (2 << 20)
    for port in (untouched.public.http, untouched.public.front):
        assert requests.post(untouched.url(port) + GENERATE, data=big, timeout=10).status_code == 413
