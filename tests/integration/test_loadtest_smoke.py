"""A short, bounded Locust run through `loadtest.run` against the session's test server.

Two users (one HTTP SSE, one gRPC stream under gevent) for 10 s with a mixed workload: fails if any
request errors, if either protocol served nothing, or if the gate's decision counters do not move.
10 s, not 20 (issue 28): a 12-token request takes well under a second, so each user still sends
several requests, and both protocols and the speculative route still come up (asserted).
"""

from __future__ import annotations

import csv

import yaml

from loadtest.metrics import delta_by, scrape
from loadtest.run import run_scenario

# tests/integration/policy.yaml: org mode off, tenant-prod prod, tenant-shadow shadow
WORKLOAD = {
    "name": "smoke",
    "max_tokens": 12,
    "temperatures": {0.0: 3, 0.9: 1},
    "tenants": [{"api_key": "tenant-prod"}, {"api_key": "tenant-shadow"}, {"api_key": None}, {"api_key": None, "spec_mode": "prod"}],
    "protocols": {"http": 1, "grpc": 1},
}


def test_locust_smoke(server, tmp_path):
    wl = tmp_path / "smoke.yaml"
    wl.write_text(yaml.safe_dump(WORKLOAD))
    before = scrape(server.metrics)
    rc, out = run_scenario(str(wl), users=2, duration="10s", host=f"http://localhost:{server.http}", out_root=tmp_path, seed=0)
    after = scrape(server.metrics)

    with open(out / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    served = {t: sum(int(r["Request Count"]) for (typ, _), r in rows.items() if typ == t) for t in ("http-sse", "grpc-stream")}
    failures = int(rows[("", "Aggregated")]["Failure Count"])
    assert rc == 0 and failures == 0, (out / "locust_failures.csv").read_text()
    assert served["http-sse"] > 0 and served["grpc-stream"] > 0, served
    assert any(typ == "TPOT" for typ, _ in rows) and any(typ == "TTFT" for typ, _ in rows)
    assert (out / "report.html").stat().st_size > 0

    moved = delta_by(before, after, "spec_gate_decisions_total", "route", "reason")  # {"route,reason": n}
    assert sum(moved.values()) >= served["http-sse"] + served["grpc-stream"], moved
    assert sum(v for k, v in moved.items() if k.startswith("speculative,")) > 0, moved
