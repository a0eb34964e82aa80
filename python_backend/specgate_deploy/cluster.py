"""`make serve REPLICAS=N`: N full replicas behind HAProxy, scraped by a Prometheus, supervised.

Each replica is a tritonserver and its front on ports of its own (replica.replica_ports); HAProxy takes
the public ports (HTTP 8000, gRPC 8001, front 9000) and Prometheus 9090. The supervisor restarts a
replica's tritonserver that died or can no longer serve (replica.py; HAProxy's health check keeps it
out until it is ready again), and HAProxy or Prometheus if either dies; a replica whose first server
never became ready ends it all, with that server's log. Ctrl-C, SIGTERM or SIGHUP drains every
replica, then stops the rest; HAProxy, Prometheus and every replica's processes also end when the
supervisor is killed.
Where each replica listens and which pids it runs: the replicas file (state.py, docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import specgate_launcher as launcher
from specgate.secret_file import ensure_secret
from specgate_deploy.balancer import start_haproxy, start_prometheus
from specgate_deploy.replica import DRAIN_S, Replica, drain_all, replica_ports
from specgate_deploy.state import ClusterState, PublicPorts, write_state
from specgate_deploy.tools import require

ROOT = launcher.ROOT
STATE_FILE = ROOT / "artifacts" / "replicas.json"
RUN_DIR = ROOT / "artifacts" / "replicas"  # rendered configs, logs, Prometheus's data


class Cluster:
    def __init__(
        self, replicas: list[Replica], public: PublicPorts, run_dir: Path, state_file: Path, bind: str, scrape_interval: str
    ) -> None:
        self.replicas, self.public, self.run_dir, self.state_file = replicas, public, run_dir, state_file
        self.bind, self.scrape_interval = bind, scrape_interval
        self.haproxy: subprocess.Popen | None = None
        self.prometheus: subprocess.Popen | None = None

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # both replicas' launchers would create them at once otherwise (ensure_secret is safe, but
        # creating them here first keeps the first start's messages in order)
        ensure_secret(launcher.LABEL_SECRET)
        ensure_secret(launcher.ADMIN_SECRET)
        for r in self.replicas:
            r.start()
        records = [r.record() for r in self.replicas]
        self.haproxy = start_haproxy(self.run_dir, records, self.public, self.bind)
        self.prometheus = start_prometheus(self.run_dir, records, self.public, self.scrape_interval)
        self.write()

    def step(self) -> None:
        """One round of supervision."""
        changed = any([r.poll() for r in self.replicas])
        records = [r.record() for r in self.replicas]
        if self.haproxy is not None and self.haproxy.poll() is not None:
            print(f"[replicas] haproxy exited with code {self.haproxy.returncode}; restarting it", flush=True)
            self.haproxy, changed = start_haproxy(self.run_dir, records, self.public, self.bind), True
        if self.prometheus is not None and self.prometheus.poll() is not None:
            print(f"[replicas] prometheus exited with code {self.prometheus.returncode}; restarting it", flush=True)
            self.prometheus, changed = start_prometheus(self.run_dir, records, self.public, self.scrape_interval), True
        if changed:
            self.write()

    def stop(self, drain_s: float) -> None:
        for r in self.replicas:
            r.status = "draining" if r.server is not None else r.status
        self.write()
        drain_all(self.replicas, drain_s)
        for p in (self.haproxy, self.prometheus):
            if p is not None:
                launcher.stop(p, timeout_s=10)
        self.write()

    def write(self) -> None:
        alive = lambda p: p.pid if p is not None and p.poll() is None else None  # noqa: E731
        write_state(self.state_file, ClusterState(
            launcher_pid=os.getpid(), haproxy_pid=alive(self.haproxy), prometheus_pid=alive(self.prometheus),
            public=self.public, replicas=[r.record() for r in self.replicas],
        ))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=_env_int("REPLICAS", 2))
    ap.add_argument("--model-repository", type=Path, default=ROOT / "artifacts" / "model_repository")
    ap.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", 8000))
    ap.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", 8001))
    ap.add_argument("--front-port", type=int, default=_env_int("FRONT_PORT", 9000))
    ap.add_argument("--prometheus-port", type=int, default=_env_int("PROMETHEUS_PORT", 9090))
    ap.add_argument("--haproxy-stats-port", type=int, default=_env_int("HAPROXY_STATS_PORT", 8404))
    ap.add_argument("--replica-base-port", type=int, default=_env_int("REPLICA_BASE_PORT", 8100),
                    help="replica i listens on BASE+10i (HTTP), +1 (gRPC), +2 (metrics), +3 (front)")
    ap.add_argument("--bind", default=os.environ.get("BIND", "*"), help="address of the public ports (HAProxy's bind)")
    ap.add_argument("--drain-s", type=int, default=_env_int("DRAIN_S", DRAIN_S))
    ap.add_argument("--scrape-interval", default=os.environ.get("SCRAPE_INTERVAL", "5s"))
    ap.add_argument("--state-file", type=Path, default=STATE_FILE)
    ap.add_argument("--run-dir", type=Path, default=RUN_DIR)
    ap.add_argument("--admin-header", default=os.environ.get("ADMIN_HEADER", launcher.ADMIN_HEADER))
    args = ap.parse_args(argv)
    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    for tool in ("haproxy", "prometheus"):  # before anything starts
        require(tool)
    if not (args.model_repository / "llm" / "config.pbtxt").exists():
        raise SystemExit(f"no model repository at {args.model_repository}: run `make build-engines`")
    public = PublicPorts(http=args.http_port, grpc=args.grpc_port, front=args.front_port, prometheus=args.prometheus_port,
                         haproxy_stats=args.haproxy_stats_port)
    replicas = [Replica(f"replica-{i}", replica_ports(args.replica_base_port, i), args.model_repository, args.run_dir, args.drain_s,
                        args.admin_header)
                for i in range(args.replicas)]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: a closed terminal, which used to kill it outright
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    cluster = Cluster(replicas, public, args.run_dir, args.state_file, args.bind, args.scrape_interval)
    try:
        cluster.start()
        print(f"[replicas] {args.replicas} replicas starting behind HAProxy: HTTP :{public.http}, gRPC :{public.grpc}, "
              f"OpenAI :{public.front}; Prometheus http://127.0.0.1:{public.prometheus}; HAProxy stats http://127.0.0.1:{public.haproxy_stats}/stats\n"
              f"[replicas] ports and pids: {args.state_file}; logs and configs: {args.run_dir}. Ctrl-C drains and stops all.", flush=True)
        while not stop.wait(1.0):
            cluster.step()
            if failed := [r for r in replicas if r.failed_to_start]:  # each would fail the same way again
                for r in failed:
                    print(r.log_tail(), flush=True)
                    print(f"[replicas] {r.name}: tritonserver exited with code {r.server.returncode} before it was ever ready "
                          f"(log above: {r.server_log}); stopping", flush=True)
                code = 1
                break
            if all(r.status == "failed" for r in replicas):  # each kept dying before it was ready: nothing serves
                print(f"[replicas] every replica was given up; stopping (logs: {args.run_dir})", flush=True)
                code = 1
                break
        else:
            print(f"[replicas] draining (up to {args.drain_s} s) ...", flush=True)
    finally:
        cluster.stop(args.drain_s)
    print("[replicas] stopped", flush=True)
    sys.exit(code)
