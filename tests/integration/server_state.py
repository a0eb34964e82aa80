"""What the integration tests read of the test server besides its answers: the resident memory of
the server and of each model's stub process, and the engines' request and KV-cache gauges."""

from __future__ import annotations

import time
from pathlib import Path

from loadtest.metrics import Samples, scrape, value
from specgate.contract import ENGINE_ACTIVE_METRIC, ENGINE_KV_METRIC
from tests.conftest import stub_pids

ENGINES = ("target_engine", "spec_engine")
MODELS = ("preprocessing", "spec_gate", *ENGINES)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def server_pid() -> int:
    """tritonserver's own pid: the parent of this suite's stubs."""
    (stub,) = stub_pids("spec_gate")
    return int(Path(f"/proc/{stub}/stat").read_text().rsplit(")", 1)[1].split()[1])


def memory() -> dict[str, float]:
    """Resident MB of the server and of every stub, by model (instances of a model summed)."""
    out = {"tritonserver": rss_mb(server_pid())}
    for model in MODELS:
        out[model] = sum(rss_mb(pid) for pid in stub_pids(model))
    return out


def engines_idle(metrics_port: int, timeout_s: float = 120) -> Samples:
    """Wait until no engine holds a request and the gate has none in flight; the metrics then."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(metrics_port)
        busy = ([m for m in ENGINES if value(samples, ENGINE_ACTIVE_METRIC, model=m)]
                + ["spec_gate"] * bool(value(samples, "spec_gate_in_flight")))
        if not busy:
            return samples
        assert time.monotonic() < deadline, f"still busy after {timeout_s:.0f} s: {busy}"
        time.sleep(0.3)


def kv_tokens(samples: Samples) -> dict[str, float]:
    return {m: value(samples, ENGINE_KV_METRIC, model=m) for m in ENGINES}
