"""The two helper processes of the replica mode: HAProxy in front, Prometheus beside."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import specgate_launcher as launcher
from specgate_deploy.config import haproxy_config, prometheus_config, rule_groups
from specgate_deploy.state import PublicPorts, ReplicaRecord
from specgate_deploy.tools import require


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    """In a session of its own (a Ctrl-C meant for the supervisor does not reach it), and ended with
    the supervisor however that ends: a SIGKILLed supervisor left HAProxy and Prometheus holding the
    public ports, and the next `make serve REPLICAS=N` could not start its own (issue 49)."""
    out = open(log, "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=launcher.die_with(os.getpid()))


def check_haproxy(cfg: Path) -> None:
    """`haproxy -c`: refuse a configuration HAProxy itself rejects, with its own message."""
    res = subprocess.run([str(require("haproxy")), "-c", "-f", str(cfg)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"haproxy rejects {cfg}:\n{res.stdout}{res.stderr}")


def start_haproxy(run_dir: Path, replicas: list[ReplicaRecord], public: PublicPorts, bind: str) -> subprocess.Popen:
    cfg = run_dir / "haproxy.cfg"
    cfg.write_text(haproxy_config(replicas, public, bind))
    check_haproxy(cfg)
    # -db: stay in the foreground, so the supervisor owns the process
    return _spawn([str(require("haproxy")), "-db", "-f", str(cfg)], run_dir / "haproxy.log")


def start_prometheus(run_dir: Path, replicas: list[ReplicaRecord], public: PublicPorts, scrape_interval: str) -> subprocess.Popen:
    rules = run_dir / "rules.yaml"
    rules.write_text(rule_groups())
    cfg = run_dir / "prometheus.yml"
    cfg.write_text(prometheus_config(replicas, public, rules, scrape_interval))
    return _spawn([
        str(require("prometheus")),
        f"--config.file={cfg}",
        f"--storage.tsdb.path={run_dir / 'prometheus-data'}",
        "--storage.tsdb.retention.time=1d",
        f"--web.listen-address=127.0.0.1:{public.prometheus}",
    ], run_dir / "prometheus.log")
