"""HAProxy's and Prometheus's configuration for a set of replicas, rendered from deploy/local/*.j2.

Templates rather than code, so an operator reads the balancer's and Prometheus's settings in their own
formats. The recording rules are taken from the Kubernetes PrometheusRule (one source for both).
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml

from specgate_deploy.state import PublicPorts, ReplicaRecord
from specgate_front.body_limit import MAX_BODY_BYTES  # the front's own bound: one limit for both

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "deploy" / "local"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "base" / "prometheus-rules.yaml"

_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def haproxy_config(replicas: list[ReplicaRecord], public: PublicPorts, bind: str = "*") -> str:
    return _env.get_template("haproxy.cfg.j2").render(replicas=replicas, public=public, bind=bind, max_body_bytes=MAX_BODY_BYTES)


def prometheus_config(replicas: list[ReplicaRecord], public: PublicPorts, rules_file: Path, scrape_interval: str = "5s") -> str:
    return _env.get_template("prometheus.yml.j2").render(replicas=replicas, public=public, rules_file=str(rules_file),
                                                         scrape_interval=scrape_interval)


def rule_groups(prometheus_rule: Path = PROMETHEUS_RULE) -> str:
    """The PrometheusRule's `spec` (its rule groups) as a plain Prometheus rules file."""
    doc = yaml.safe_load(prometheus_rule.read_text())
    if doc.get("kind") != "PrometheusRule":
        raise ValueError(f"{prometheus_rule} is not a PrometheusRule")
    return yaml.safe_dump({"groups": doc["spec"]["groups"]}, sort_keys=False)
