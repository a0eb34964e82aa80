"""deploy/Dockerfile{,.gpu} (no container runtime here to build them: checked as text), the replicas
file, and the replica mode's refusal to run without HAProxy and Prometheus."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "deploy" / "Dockerfile"
GPU = ROOT / "deploy" / "Dockerfile.gpu"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_image_runs_non_root_checks_health_and_drains(path: Path) -> None:
    ins = instructions(path)
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = next(a for i, a in ins if i == "HEALTHCHECK")
    assert "/v2/health/ready" in health
    assert ("STOPSIGNAL", "SIGTERM") in ins
    entry = next(a for i, a in ins if i == "ENTRYPOINT")
    assert "specgate_deploy.pod" in entry
    assert {"8000", "8001", "8002", "9000"} <= set(next(a for i, a in ins if i == "EXPOSE").split())
    assert "NOT BUILT" in path.read_text()  # says it was never built here


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_image_builds_with_the_steps_ci_runs(path: Path) -> None:
    """Every `make` the image runs is a target .ci/run reaches (make test -> build-engines -> setup)."""
    runs = [a for i, a in instructions(path) if i == "RUN"]
    targets = {t for r in runs for m in re.finditer(r"(?:^|&&|;)\s*make\s+([^&;]+)", r) for t in m.group(1).split() if "=" not in t}
    assert targets == {"setup", "build-engines"}
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_gpu_image_is_the_pinned_one() -> None:
    from build.trtllm.pins import NGC_IMAGE, TRTLLM_TAG

    ins = instructions(GPU)
    assert ("ARG", f"BASE_IMAGE={NGC_IMAGE}") in ins
    assert any(i == "RUN" and f"-b {TRTLLM_TAG}" in a for i, a in ins)


def test_replicas_file_round_trip(tmp_path: Path) -> None:
    from specgate_deploy.replica import replica_ports
    from specgate_deploy.state import ClusterState, PortSet, PublicPorts, ReplicaRecord, read_state, write_state

    ports = replica_ports(8100, 1)
    assert (ports.http, ports.grpc, ports.metrics, ports.front) == (8110, 8111, 8112, 8113)
    state = ClusterState(launcher_pid=1, haproxy_pid=2, prometheus_pid=None,
                         public=PublicPorts(http=8000, grpc=8001, front=9000, prometheus=9090, haproxy_stats=8404),
                         replicas=[ReplicaRecord(name="replica-1", ports=PortSet(**vars(ports)), tritonserver_pid=3, front_pid=4, status="ready")])
    write_state(tmp_path / "replicas.json", state)
    assert read_state(tmp_path / "replicas.json") == state
    assert not list(tmp_path.glob(".*tmp"))


def test_replica_mode_names_the_packages_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgate_deploy import tools

    monkeypatch.setattr(tools.shutil, "which", lambda _: None)
    monkeypatch.setattr(tools, "_EXTRA_DIRS", ())
    with pytest.raises(SystemExit, match=r"apt-get install haproxy prometheus"):
        tools.require("haproxy")


def test_pod_copies_mounted_secrets_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import specgate_launcher
    from specgate.secret_file import read_secret
    from specgate_deploy import pod

    mount = tmp_path / "mount"
    mount.mkdir()
    for name in ("admin.key", "label.key"):
        (mount / name).write_text(f"{name}-value\n")
        (mount / name).chmod(0o440)  # as the kubelet mounts a Secret for an fsGroup
    monkeypatch.setattr(specgate_launcher, "SECRETS", tmp_path / "secrets")
    assert pod.install_secrets(mount) == ["admin.key", "label.key"]
    assert read_secret(tmp_path / "secrets" / "admin.key") == "admin.key-value"  # 0600: accepted
