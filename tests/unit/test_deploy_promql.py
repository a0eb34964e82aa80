"""Every PromQL expression we ship, checked by Prometheus's own promtool (Debian's `prometheus`):
the recording rules (`promtool check rules`, and `promtool test rules` on made-up series), every
dashboard query, the adapter's query; and HAProxy's and Prometheus's configs for `make serve
REPLICAS=N` (`haproxy -c`, `promtool check config`).

promtool has no query-parse command in Debian's 2.42, so the dashboard's queries are checked as
recording rules (the same parser), with Grafana's variables given values first.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from specgate_deploy.config import PROMETHEUS_RULE, haproxy_config, prometheus_config, rule_groups
from specgate_deploy.state import PortSet, PublicPorts, ReplicaRecord
from specgate_deploy.tools import INSTALL_HINT, which

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = which("promtool")
HAPROXY = which("haproxy")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool missing ({INSTALL_HINT}; .ci/run installs it)")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason=f"haproxy missing ({INSTALL_HINT}; .ci/run installs it)")

# Grafana's variables, as Grafana would fill them in
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*", "$tenant": ".*", "${datasource}": ""}


def grafana_expr(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def dashboard_queries() -> list[str]:
    d = json.loads((ROOT / "dashboards" / "specgate.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in d["templating"]["list"] if v.get("type") == "query"]
    return exprs


def label_values_metric(expr: str) -> str | None:
    """`label_values(metric, label)` (a Grafana function, not PromQL) -> the series it reads."""
    m = re.fullmatch(r"label_values\((\w+), *\w+\)", expr)
    return m.group(1) if m else None


def promql(expr: str) -> str:
    return label_values_metric(expr) or grafana_expr(expr)


def adapter_queries() -> list[str]:
    """Each of the adapter's queries as it sends it: its series and one namespace's pods filled in."""
    rules = yaml.safe_load((ROOT / "deploy" / "k8s" / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    return [r["metricsQuery"].replace("<<.GroupBy>>", "namespace, pod").replace("<<.Series>>", r["name"]["as"]).replace(
        "<<.LabelMatchers>>", 'namespace="default",pod=~"specgate-.*"') for r in rules]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@needs_promtool
def test_recording_rules_pass_promtool(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(rule_groups(PROMETHEUS_RULE))
    res = promtool("check", "rules", str(rules))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 7 rules found" in res.stdout


@needs_promtool
def test_recording_rules_compute_what_they_say(tmp_path: Path) -> None:
    """promtool's rule unit tests on made-up series: two pods, one queuing twice as long as it computes."""
    (tmp_path / "rules.yaml").write_text(rule_groups(PROMETHEUS_RULE))
    pod = lambda p: f'namespace="ns", pod="{p}"'  # noqa: E731
    series = [
        # per minute: pod a queues 120 s and computes 60 s; pod b queues nothing
        {"series": f'nv_inference_queue_duration_us{{{pod("a")}, model="llm"}}', "values": "0+120000000x10"},
        {"series": f'nv_inference_compute_infer_duration_us{{{pod("a")}, model="llm"}}', "values": "0+60000000x10"},
        {"series": f'nv_inference_queue_duration_us{{{pod("b")}, model="llm"}}', "values": "0+0x10"},
        {"series": f'nv_inference_compute_infer_duration_us{{{pod("b")}, model="llm"}}', "values": "0+60000000x10"},
        # drafts: a accepts 3 of 4 tokens, b 1 of 4; 2 drafts each per minute
        {"series": f'spec_decode_num_draft_tokens_total{{{pod("a")}}}', "values": "0+8x10"},
        {"series": f'spec_decode_num_accepted_tokens_total{{{pod("a")}}}', "values": "0+6x10"},
        {"series": f'spec_decode_num_drafts_total{{{pod("a")}}}', "values": "0+2x10"},
        {"series": f'spec_decode_num_draft_tokens_total{{{pod("b")}}}', "values": "0+8x10"},
        {"series": f'spec_decode_num_accepted_tokens_total{{{pod("b")}}}', "values": "0+2x10"},
        {"series": f'spec_decode_num_drafts_total{{{pod("b")}}}', "values": "0+2x10"},
        {"series": f'spec_gate_decisions_total{{{pod("a")}, route="speculative", reason="prod"}}', "values": "0+60x10"},
        {"series": f'spec_gate_decisions_total{{{pod("b")}, route="baseline", reason="circuit_open"}}', "values": "0+30x10"},
        # the gate's queue: pod a has 4 waiting in one gate instance and 2 in the other, pod b none
        {"series": f'spec_gate_queued{{{pod("a")}, instance="0"}}', "values": "4x10"},
        {"series": f'spec_gate_queued{{{pod("a")}, instance="1"}}', "values": "2x10"},
        {"series": f'spec_gate_queued{{{pod("b")}, instance="0"}}', "values": "0x10"},
    ]
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": "triton:queue_compute:ratio", "eval_time": "5m", "exp_samples": [
                {"labels": f'triton:queue_compute:ratio{{{pod("a")}, model="llm"}}', "value": 2},
                {"labels": f'triton:queue_compute:ratio{{{pod("b")}, model="llm"}}', "value": 0}]},
            {"expr": "namespace:spec_decode_acceptance:ratio_rate1m", "eval_time": "5m", "exp_samples": [
                {"labels": 'namespace:spec_decode_acceptance:ratio_rate1m{namespace="ns"}', "value": 0.5}]},
            {"expr": "pod:spec_decode_acceptance:ratio_rate1m", "eval_time": "5m", "exp_samples": [
                {"labels": f'pod:spec_decode_acceptance:ratio_rate1m{{{pod("a")}}}', "value": 0.75},
                {"labels": f'pod:spec_decode_acceptance:ratio_rate1m{{{pod("b")}}}', "value": 0.25}]},
            {"expr": "namespace:spec_decode_mean_acceptance_length:rate1m", "eval_time": "5m", "exp_samples": [
                {"labels": 'namespace:spec_decode_mean_acceptance_length:rate1m{namespace="ns"}', "value": 3}]},
            {"expr": "namespace_route_reason:spec_gate_decisions:rate1m", "eval_time": "5m", "exp_samples": [
                {"labels": 'namespace_route_reason:spec_gate_decisions:rate1m{namespace="ns", route="speculative", reason="prod"}',
                 "value": 1},
                {"labels": 'namespace_route_reason:spec_gate_decisions:rate1m{namespace="ns", route="baseline", reason="circuit_open"}',
                 "value": 0.5}]},
            {"expr": "pod:spec_gate_queued:avg1m", "eval_time": "5m", "exp_samples": [
                {"labels": f'pod:spec_gate_queued:avg1m{{{pod("a")}}}', "value": 6},
                {"labels": f'pod:spec_gate_queued:avg1m{{{pod("b")}}}', "value": 0}]},
            {"expr": "pod_reason:spec_gate_decisions:rate1m", "eval_time": "5m", "exp_samples": [
                {"labels": f'pod_reason:spec_gate_decisions:rate1m{{{pod("a")}, reason="prod"}}', "value": 1},
                {"labels": f'pod_reason:spec_gate_decisions:rate1m{{{pod("b")}, reason="circuit_open"}}', "value": 0.5}]},
        ],
    }]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    res = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_dashboard_and_adapter_queries_parse(tmp_path: Path) -> None:
    exprs = [promql(e) for e in dashboard_queries()] + adapter_queries()
    assert len(exprs) > 20
    rules = {"groups": [{"name": "parse", "rules": [{"record": f"parse:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rules))
    res = promtool("check", "rules", str(tmp_path / "q.yaml"))
    assert res.returncode == 0, res.stdout + res.stderr
    # and the check can fail
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "bad:q", "expr": "sum(rate(x[1m])"}]}]})
    )
    assert promtool("check", "rules", str(tmp_path / "bad.yaml")).returncode != 0


def _two_replicas() -> tuple[list[ReplicaRecord], PublicPorts]:
    from specgate_deploy.replica import replica_ports

    recs = [ReplicaRecord(name=f"replica-{i}", ports=PortSet(**vars(replica_ports(29100, i))), tritonserver_pid=None, front_pid=None,
                          status="starting")
            for i in range(2)]
    return recs, PublicPorts(http=29080, grpc=29081, front=29089, prometheus=29090, haproxy_stats=29091)


@needs_haproxy
def test_haproxy_accepts_the_rendered_config(tmp_path: Path) -> None:
    recs, public = _two_replicas()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(recs, public, "127.0.0.1"))
    res = subprocess.run([str(HAPROXY), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    text = cfg.read_text()
    assert text.count("check port 29100") == 1 and "retry-on conn-failure empty-response 502\n" in text  # gRPC's check; not 503
    cfg.write_text(text.replace("retry-on conn-failure", "retry-on conn-failures"))
    assert subprocess.run([str(HAPROXY), "-c", "-f", str(cfg)], capture_output=True, timeout=30).returncode != 0


@needs_promtool
def test_prometheus_accepts_the_rendered_config(tmp_path: Path) -> None:
    recs, public = _two_replicas()
    rules = tmp_path / "rules.yaml"
    rules.write_text(rule_groups(PROMETHEUS_RULE))
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(prometheus_config(recs, public, rules))
    res = promtool("check", "config", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    jobs = yaml.safe_load(cfg.read_text())["scrape_configs"]
    assert [t["labels"]["pod"] for t in jobs[0]["static_configs"]] == ["replica-0", "replica-1"]
