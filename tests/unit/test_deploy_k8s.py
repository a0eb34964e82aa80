"""deploy/k8s: every resource both overlays render validates against Kubernetes' own schemas
(kubernetes-validate, pinned Kubernetes version), and the manifests say what docs/deploy.md says.

ServiceMonitor and PrometheusRule are the Prometheus Operator's CRDs, whose schemas the validator
does not ship: they are checked against models of the fields we use here (extra fields rejected),
written from the operator's API reference (monitoring.coreos.com/v1).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from tests.unit.k8s_render import K8S, OVERLAYS, ROOT, kustomize_command, render

KUBERNETES_VERSION = "1.32.0"  # pinned: the cluster version the manifests are checked against
CRDS = {"ServiceMonitor", "PrometheusRule"}

pytestmark = pytest.mark.skipif(kustomize_command() is None,
                                reason="no kustomize renderer: neither `kustomize` nor `kubectl` is on PATH (k8s_render.py)")


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
    extra = {"PersistentVolumeClaim"} if overlay == "gpu" else set()  # the engines' volume
    assert {d["kind"] for d in docs} == {"ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                        "NetworkPolicy", *CRDS, *extra}
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
    pod = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # ready: Triton ready, the front answering, a calibration published (the front's endpoint says all three)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {p["containerPort"] for p in c["ports"]} == {8000, 8001, 8002, 9000}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0


def test_the_grace_period_covers_the_longest_stop_the_code_allows(rendered: dict[str, list[dict]]) -> None:
    """The kubelet's SIGKILL comes terminationGracePeriodSeconds after preStop starts: preStop, then
    everything the pod's entrypoint may wait for after SIGTERM (test_deploy_replica measures that)."""
    from specgate_deploy.pod import worst_stop_s

    for overlay in OVERLAYS:
        pod = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
        c = pod["containers"][0]
        drain_s = int({e["name"]: e.get("value") for e in c["env"]}["DRAIN_S"])
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + worst_stop_s(drain_s), overlay


def test_the_hpa_owns_the_replica_count(rendered: dict[str, list[dict]]) -> None:
    """A count in the Deployment would reset the HPA's at every `kubectl apply -k`."""
    for overlay in OVERLAYS:
        assert "replicas" not in one(rendered[overlay], "Deployment")["spec"]


def test_the_pod_writes_only_to_its_empty_dirs(rendered: dict[str, list[dict]]) -> None:
    """Read-only root filesystem, no service account token; the writable folders are the image's own
    (deploy/Dockerfile makes them for the server's user), which `make image-test` runs read-only too."""
    from build.image import writable_dirs

    pod = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["automountServiceAccountToken"] is False and c["securityContext"]["readOnlyRootFilesystem"] is True
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty} - {"/dev/shm"}
    assert writable == {"/tmp", *writable_dirs()} and len(writable) == 6


def test_replicas_spread_over_nodes(rendered: dict[str, list[dict]]) -> None:
    pod = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    (spread,) = pod["topologySpreadConstraints"]
    assert (spread["topologyKey"] == "kubernetes.io/hostname"
            and spread["labelSelector"]["matchLabels"] == one(rendered["cpu"], "Deployment")["spec"]["selector"]["matchLabels"])
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still runs both


def test_network_policy_admits_only_the_serving_ports_and_metrics_from_monitoring(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu"]
    policy = one(docs, "NetworkPolicy")["spec"]
    names = {p["name"]: p["containerPort"] for p in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert (policy["podSelector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
            and policy["policyTypes"] == ["Ingress"])
    anyone = [r for r in policy["ingress"] if "from" not in r]
    scoped = [r for r in policy["ingress"] if "from" in r]
    assert {names[p["port"]] for r in anyone for p in r["ports"]} == {9000, 8000, 8001}
    (monitoring,) = scoped
    assert {names[p["port"]] for p in monitoring["ports"]} == {8002}
    assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_service_ports_and_monitor(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu"]
    svc = one(docs, "Service")
    assert {p["port"]: p["name"] for p in svc["spec"]["ports"]} == {8000: "http", 8001: "grpc", 8002: "metrics", 9000: "openai"}
    mon = one(docs, "ServiceMonitor")
    assert mon["spec"]["endpoints"][0]["port"] == "metrics"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    dep = one(docs, "Deployment")
    assert (svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
            == one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])


def test_hpa_scales_on_the_recording_rules(rendered: dict[str, list[dict]]) -> None:
    """Triton's queue:compute ratio, and the gate's admission queue, where the CPU path waits."""
    docs = rendered["cpu"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    records = {r["record"]: r["expr"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert metrics == ["triton:queue_compute:ratio", "pod:spec_gate_queued:avg1m"]
    # NVIDIA's expression, unchanged
    assert records[metrics[0]] == ("rate(nv_inference_queue_duration_us[1m]) / "
                                   "clamp_min(rate(nv_inference_compute_infer_duration_us[1m]), 1)")
    assert "spec_gate_queued" in records[metrics[1]]
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert [r["name"]["as"] for r in adapter["rules"]["custom"]] == metrics
    assert all(r["seriesQuery"].startswith(name + "{") for r, name in zip(adapter["rules"]["custom"], metrics))
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


def test_the_adapter_asks_the_operators_prometheus_and_relists_often() -> None:
    """Without a url the adapter asks the chart's default, where no Prometheus answers, and the HPA reads
    <unknown>; the chart's minute between relists leaves a new pod uncounted for up to a minute."""
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert adapter["prometheus"]["url"].startswith("http://") and ".monitoring.svc" in adapter["prometheus"]["url"]
    assert adapter["prometheus"]["port"] == 9090
    interval = re.fullmatch(r"(\d+)s", adapter["metricsRelistInterval"])
    assert interval and int(interval.group(1)) <= 15  # the HPA's own sync period


def test_the_operator_selects_the_monitor_and_the_rules_by_a_kustomize_setting(tmp_path: Path, rendered: dict[str, list[dict]]) -> None:
    """kube-prometheus-stack's Prometheus picks ServiceMonitors and PrometheusRules by `release`: the
    label is one patch value in the base's kustomization.yaml, and it reaches both and nothing else."""
    def released(docs: list[dict]) -> dict[str, str]:
        return {d["kind"]: d["metadata"]["labels"]["release"] for d in docs if "release" in d["metadata"].get("labels", {})}

    assert released(rendered["cpu"]) == {"ServiceMonitor": "prometheus", "PrometheusRule": "prometheus"}
    kustomization = tmp_path / "k8s" / "base" / "kustomization.yaml"
    render("cpu", tmp_path)  # the tree copied
    kustomization.write_text(kustomization.read_text().replace("value: prometheus}", "value: kps}"))
    assert released(render("cpu", tmp_path)) == {"ServiceMonitor": "kps", "PrometheusRule": "kps"}


def test_the_cpu_pod_is_guaranteed(rendered: dict[str, list[dict]]) -> None:
    """Requests equal to limits: the kubelet's static CPU manager pins a Guaranteed pod's whole cores."""
    res = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] and set(res["limits"]) == {"cpu", "memory"}


def test_the_gpu_pod_builds_its_engines_in_an_init_container(rendered: dict[str, list[dict]]) -> None:
    pod = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    main = pod["containers"][0]
    assert init["image"] == main["image"] == "specgate:gpu" and init["args"] == ["--build-only"]
    claim = one(rendered["gpu"], "PersistentVolumeClaim")
    engines = next(v for v in pod["volumes"] if v["name"] == "engines")
    assert engines["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"] and "ReadWriteMany" in claim["spec"]["accessModes"]
    mounts = lambda c: {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}  # noqa: E731
    assert mounts(init)["/engines"] is False and mounts(main)["/engines"] is True
    served = "/app/artifacts/served"  # the rendered repository: the GPU image's entrypoint serves it
    assert mounts(init)[served] is False and mounts(main)[served] is True
    assert served in (ROOT / "deploy" / "Dockerfile.gpu").read_text()


def test_dashboard_copy_is_the_dashboard() -> None:
    copy_ = K8S / "base" / "grafana" / "specgate.json"
    assert copy_.read_text() == (ROOT / "dashboards" / "specgate.json").read_text(), (
        f"cp dashboards/specgate.json {copy_.relative_to(ROOT)}"
    )


def test_overlays_differ_only_in_image_resources_and_gpu(rendered: dict[str, list[dict]]) -> None:
    def strip(docs: list[dict]) -> list[dict]:
        docs = copy.deepcopy([d for d in docs if d["kind"] != "PersistentVolumeClaim"])
        for d in docs:
            if d["kind"] == "Deployment":
                spec = d["spec"]["template"]["spec"]
                for k in ("tolerations", "initContainers"):
                    spec.pop(k, None)
                spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in ("engines", "served")]
                for c in spec["containers"]:
                    for k in ("image", "resources"):
                        c.pop(k)
                    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in ("engines", "served")]
        return docs

    assert strip(rendered["cpu"]) == strip(rendered["gpu"])
    gpu = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["image"] == "specgate:gpu"
    assert "nvidia.com/gpu" not in one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
