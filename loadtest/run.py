"""`make loadtest`: run Locust headless against a running server, one scenario after another.

    python -m loadtest.run --scenario gated --users 4 --duration 60s --host http://localhost:8000

Writes results/loadtest/<scenario>/: locust_stats.csv (+ _stats_history, _failures, _exceptions),
report.html, and gate_metrics.json (deltas of the gate's counters on the metrics port over the run).
Exit status is non-zero if any request failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from loadtest import metrics
from loadtest.workloads import SCENARIOS, load

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
USER_CLASSES = {"http": "HttpStreamUser", "grpc": "GrpcStreamUser"}


def run_scenario(
    workload: str,
    users: int,
    duration: str,
    host: str,
    out_root: Path,
    grpc_url: str | None = None,
    metrics_url: str | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    request_timeout_s: float = 120,
) -> tuple[int, Path]:
    """Run one workload (scenario name or YAML path); returns (Locust's exit status, output dir)."""
    wl = load(workload)
    out = out_root / wl.name
    out.mkdir(parents=True, exist_ok=True)
    u = urlparse(host)
    metrics_url = metrics_url or f"http://{u.hostname}:{(u.port or 8000) + 2}/metrics"
    # PYTHONPATH: `loadtest` for the locustfile
    env = {**os.environ, "SPECGATE_WORKLOAD": workload, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key, val in (("SPECGATE_GRPC_URL", grpc_url), ("SPECGATE_MAX_TOKENS", max_tokens), ("SPECGATE_SEED", seed),
                     ("SPECGATE_REQUEST_TIMEOUT", request_timeout_s)):
        if val is not None:
            env[key] = str(val)
    classes = [USER_CLASSES[p] for p, w in wl.protocols.items() if w > 0]
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--users", str(users), "--spawn-rate", str(users), "--run-time", duration,
        # in-flight generations finish (or time out, as failures) and are counted, not cut off
        "--stop-timeout", str(math.ceil(request_timeout_s)),
        "--host", host, "--csv", str(out / "locust"), "--csv-full-history", "--html", str(out / "report.html"),
        "--only-summary", "--loglevel", "WARNING", *classes,
    ]
    before = metrics.scrape(metrics_url)
    t0 = time.time()
    print(f"[loadtest] {wl.name}: {users} users, {duration}, {host} -> {out}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        rc = proc.wait(timeout=seconds(duration) + 2 * request_timeout_s + 60)
    except subprocess.TimeoutExpired:  # last resort: Locust writes its CSV and HTML on SIGTERM
        print(f"[loadtest] {wl.name}: Locust did not stop in time; sending SIGTERM", flush=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        rc = 1  # a run that had to be stopped has failed
    gate = metrics.gate_deltas(before, metrics.scrape(metrics_url))
    (out / "gate_metrics.json").write_text(json.dumps(
        {"scenario": wl.name, "users": users, "duration": duration, "started": t0, "wall_s": time.time() - t0, **gate}, indent=2
    ))
    print(f"[loadtest] {wl.name}: gate decisions {gate['decisions']}", flush=True)
    return rc, out


def seconds(timespan: str) -> float:
    """Locust's --run-time syntax: 90, 90s, 2m, 1h30m."""
    if timespan.isdigit():
        return float(timespan)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", timespan)
    if not parts or not timespan:
        raise ValueError(f"bad duration {timespan!r}; use e.g. 60s, 2m, 1h30m")
    h, m, s = (int(x or 0) for x in parts.groups())
    return 3600 * h + 60 * m + s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="all", help=f"{', '.join(SCENARIOS)}, all, or a workload YAML file")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--duration", default="60s", help="Locust --run-time per scenario (e.g. 60s, 2m)")
    ap.add_argument("--host", default=os.environ.get("SPECGATE_HOST", "http://localhost:8000"), help="HTTP base URL")
    ap.add_argument("--grpc-url", default=None, help="host:port (default: --host's port + 1)")
    ap.add_argument("--metrics-url", default=None, help="default: http://<host>:<port + 2>/metrics")
    ap.add_argument("--max-tokens", type=int, default=None, help="override the workload's max_tokens")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--request-timeout", type=float, default=120, help="seconds without a response before a request fails")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "loadtest")
    args = ap.parse_args()
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    failed = []
    for s in scenarios:
        rc, _ = run_scenario(s, args.users, args.duration, args.host, args.out, args.grpc_url, args.metrics_url, args.max_tokens, args.seed,
                             args.request_timeout)
        if rc:
            failed.append(s)
    if failed:
        sys.exit(f"[loadtest] requests failed in: {', '.join(failed)} (see results/loadtest/<scenario>/locust_failures.csv)")


if __name__ == "__main__":
    main()
