"""Locust users for the `llm` entry point: HTTP generate_stream (SSE) and gRPC streaming.

Both go through `specgate_client`. Each request is reported to Locust as several entries, so
Locust's stats, CSV and HTML carry the LLM metrics (type / name):

- `<proto>` / `<route>`: end-to-end latency in ms; "size" is output tokens; failures counted here
  (route `-` when the request failed before any route came back).
- `TTFT` / `<proto> <route>`: time to first token, ms.
- `TPOT` / `<proto> <route>`: time per output token after the first, ms.
- `tokens/s` / `<proto> <route>`: per-request output tokens per second. Locust labels every
  "response time" column ms; for this type the number is tokens/s.

Configuration (environment, set by `python -m loadtest.run`):
  SPECGATE_WORKLOAD   scenario name (loadtest/workloads.py) or YAML file      (default: gated)
  SPECGATE_MAX_TOKENS overrides the workload's max_tokens
  SPECGATE_GRPC_URL   gRPC host:port (default: the --host's host, port + 1)
  SPECGATE_SEED       seeds the per-user request sampling (user i uses seed + i)
  SPECGATE_REQUEST_TIMEOUT  seconds without a response before a request counts as failed (default 120)
"""

from __future__ import annotations

import itertools
import os
import random
from urllib.parse import urlparse

# tritonclient's gRPC stream runs grpc's blocking C core on a reader thread; under Locust's gevent
# monkey patching that thread is a greenlet and would block the whole hub without this.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import User, constant, task  # noqa: E402

from loadtest.measure import Sample, StreamingClient, timed  # noqa: E402
from loadtest.workloads import Workload, load  # noqa: E402
from specgate_client import GrpcClient, HttpClient  # noqa: E402

_max_tokens = os.environ.get("SPECGATE_MAX_TOKENS")
WORKLOAD: Workload = load(os.environ.get("SPECGATE_WORKLOAD", "gated")).with_overrides(max_tokens=int(_max_tokens) if _max_tokens else None)
REQUEST_TIMEOUT_S = float(os.environ.get("SPECGATE_REQUEST_TIMEOUT", 120))
_user_ids = itertools.count()


def grpc_url(host: str) -> str:
    if url := os.environ.get("SPECGATE_GRPC_URL"):
        return url
    u = urlparse(host if "//" in host else f"http://{host}")
    return f"{u.hostname}:{(u.port or 8000) + 1}"


class _LLMUser(User):
    abstract = True
    wait_time = constant(0)  # closed loop: concurrency equals the number of users
    protocol: str

    def make_client(self) -> StreamingClient:
        raise NotImplementedError

    def on_start(self) -> None:
        seed = os.environ.get("SPECGATE_SEED")
        self.rng = random.Random(None if seed is None else int(seed) + next(_user_ids))
        self.llm = self.make_client()

    @task
    def generate(self) -> None:
        self.report(timed(self.llm, WORKLOAD.sample(self.rng)))

    def report(self, s: Sample) -> None:
        fire = self.environment.events.request.fire
        context = {"category": s.category, "temperature": s.temperature, "reason": s.reason}
        fire(request_type=self.protocol, name=s.route, response_time=s.e2e_s * 1000, response_length=s.tokens,
             exception=None if s.ok else RuntimeError(s.error), context=context)
        if not s.ok:
            return
        name = f"{self.protocol} {s.route}"
        fire(request_type="TTFT", name=name, response_time=s.ttft_s * 1000, response_length=0, exception=None, context=context)
        if s.tokens > 1:
            fire(request_type="TPOT", name=name, response_time=s.tpot_s * 1000, response_length=0, exception=None, context=context)
        fire(request_type="tokens/s", name=name, response_time=s.tokens_per_s, response_length=0, exception=None, context=context)


class HttpStreamUser(_LLMUser):
    protocol = "http-sse"
    weight = WORKLOAD.protocols.get("http", 0)

    def make_client(self) -> StreamingClient:
        return HttpClient(self.host, timeout_s=REQUEST_TIMEOUT_S)


class GrpcStreamUser(_LLMUser):
    protocol = "grpc-stream"
    weight = WORKLOAD.protocols.get("grpc", 0)

    def make_client(self) -> StreamingClient:
        return GrpcClient(grpc_url(self.host), timeout_s=REQUEST_TIMEOUT_S)
