"""deploy/k8s: every resource both overlays render validates against Kubernetes' own schemas
(kubernetes-validate, pinned Kubernetes version), and the manifests say what docs/deploy.md says.

ServiceMonitor and PrometheusRule are the Prometheus Operator's CRDs, whose schemas the validator
does not ship: they are checked against models of the fields we use here (extra fields rejected),
written from the operator's API reference (monitoring.coreos.com/v1).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from tests.unit.k8s_render import K8S, OVERLAYS, ROOT, kustomize_command, render

KUBERNETES_VERSION = "1.32.0"  # pinned: the cluster version the manifests are checked against
CRDS = {"ServiceMonitor", "PrometheusRule"}

pytestmark = pytest.mark.skipif(kustomize_command() is None, reason="no kustomize renderer: neither `kustomize` nor `kubectl` is on PATH (k8s_render.py)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("k8s")
    return {o: render(o, tmp) for o in OVERLAYS}


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Rule(_Strict):
    record: str
    expr: str
    labels: dict[str, str] | None = None


class _Group(_Strict):
    name: str
    interval: str | None = None
    rules: list[_Rule]


class _Meta(_Strict):
    name: str
    labels: dict[str, str] | None = None
    namespace: str | None = None


class PrometheusRule(_Strict):
    apiVersion: Literal["monitoring.coreos.com/v1"]
    kind: Literal["PrometheusRule"]
    metadata: _Meta

    class _Spec(_Strict):
        groups: list[_Group]

    spec: _Spec


class ServiceMonitor(_Strict):
    apiVersion: Literal["monitoring.coreos.com/v1"]
    kind: Literal["ServiceMonitor"]
    metadata: _Meta

    class _Selector(_Strict):
        matchLabels: dict[str, str]

    class _Endpoint(_Strict):
        port: str
        path: str = "/metrics"
        interval: str | None = None

    class _Spec(_Strict):
        selector: "ServiceMonitor._Selector"
        endpoints: list["ServiceMonitor._Endpoint"]

    spec: _Spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_resource_validates(rendered: dict[str, list[dict]], overlay: str) -> None:
    import kubernetes_validate

    docs = rendered[overlay]
    assert {d["kind"] for d in docs} == {"ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", *CRDS}
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            PrometheusRule.model_validate(doc)
        elif doc["kind"] == "ServiceMonitor":
            ServiceMonitor.model_validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_fails_validation(rendered: dict[str, list[dict]]) -> None:
    """The validator can fail: a probe port that is no port, and an unknown field."""
    import kubernetes_validate

    dep = copy.deepcopy(one(rendered["cpu"], "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True)
    with pytest.raises(ValueError):
        ServiceMonitor.model_validate({**one(rendered["cpu"], "ServiceMonitor"), "spec": {"selector": {}, "endpoint": []}})


def test_deployment_probes_and_drain(rendered: dict[str, list[dict]]) -> None:
    from specgate_deploy.replica import DRAIN_S

    pod = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["DRAIN_S"]) == DRAIN_S
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    # the kubelet's SIGKILL comes after the grace period, counted from preStop's start
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + DRAIN_S + 5
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert {p["containerPort"] for p in c["ports"]} == {8000, 8001, 8002, 9000}


def test_service_ports_and_monitor(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu"]
    svc = one(docs, "Service")
    assert {p["port"]: p["name"] for p in svc["spec"]["ports"]} == {8000: "http", 8001: "grpc", 8002: "metrics", 9000: "openai"}
    mon = one(docs, "ServiceMonitor")
    assert mon["spec"]["endpoints"][0]["port"] == "metrics"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    dep = one(docs, "Deployment")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]


def test_hpa_scales_on_the_recording_rule(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    records = {r["record"]: r["expr"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert metric == "triton:queue_compute:ratio"
    # NVIDIA's expression, unchanged
    assert records[metric] == "rate(nv_inference_queue_duration_us[1m]) / clamp_min(rate(nv_inference_compute_infer_duration_us[1m]), 1)"
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert adapter["rules"]["custom"][0]["name"]["as"] == metric
    # one of two pods may always go, so the PDB never blocks a node drain at the HPA's minimum
    assert hpa["spec"]["minReplicas"] > one(docs, "PodDisruptionBudget")["spec"]["minAvailable"]


def test_config_maps_secrets_and_mounts(rendered: dict[str, list[dict]]) -> None:
    from specgate.gate.policy import Policy

    docs = rendered["cpu"]
    policy_cm = one(docs, "ConfigMap", "specgate-policy")
    dash = one(docs, "ConfigMap", "specgate-dashboard")
    secret = one(docs, "Secret", "specgate-secrets")
    assert json.loads(dash["data"]["specgate.json"]) == json.loads((ROOT / "dashboards" / "specgate.json").read_text())
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(secret["data"]) == {"tenants.yaml", "admin.key", "label.key"}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # mounted as folders (a subPath mount never sees an update, so no hot reload)
    assert not any("subPath" in m for m in mounts.values())
    assert volumes["policy"]["configMap"]["name"] == "specgate-policy" and mounts["policy"]["mountPath"] == "/app/policy"
    assert volumes["secrets"]["secret"]["secretName"] == "specgate-secrets"
    # the policy the pods load: the shipped one but for the key file (the Secret's) and override
    k8s = Policy.model_validate(yaml.safe_load(policy_cm["data"]["default.yaml"]))
    shipped = Policy.model_validate(yaml.safe_load((ROOT / "policy" / "default.yaml").read_text()))
    assert Path(k8s.key_file).parent == Path(mounts["secrets"]["mountPath"]) and k8s.allow_override is False
    assert k8s.model_copy(update={"key_file": None, "allow_override": True}) == shipped


def test_dashboard_copy_is_the_dashboard() -> None:
    copy_ = K8S / "base" / "grafana" / "specgate.json"
    assert copy_.read_text() == (ROOT / "dashboards" / "specgate.json").read_text(), f"cp dashboards/specgate.json {copy_.relative_to(ROOT)}"


def test_overlays_differ_only_in_image_resources_and_gpu(rendered: dict[str, list[dict]]) -> None:
    def strip(docs: list[dict]) -> list[dict]:
        docs = copy.deepcopy(docs)
        for d in docs:
            if d["kind"] == "Deployment":
                spec = d["spec"]["template"]["spec"]
                spec.pop("tolerations", None)
                for c in spec["containers"]:
                    for k in ("image", "resources", "startupProbe"):
                        c.pop(k)
        return docs

    assert strip(rendered["cpu"]) == strip(rendered["gpu"])
    gpu = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["image"] == "specgate:gpu"
    assert "nvidia.com/gpu" not in one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
