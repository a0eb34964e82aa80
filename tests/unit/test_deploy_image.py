"""deploy/Dockerfile{,.gpu} as text (`make image-test` builds and runs the CPU one), their build
context, the replicas file, and the replica mode's refusal to run without HAProxy and Prometheus."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from build.build_context import DockerIgnore, context_files

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
    assert "9000/health/ready" in health  # the pod's readiness: Triton, the front, a calibration
    assert ("STOPSIGNAL", "SIGTERM") in ins
    entry = next(a for i, a in ins if i == "ENTRYPOINT")
    assert "specgate_deploy.pod" in entry
    assert {"8000", "8001", "8002", "9000"} <= set(next(a for i, a in ins if i == "EXPOSE").split())
    assert ("NOT BUILT" in path.read_text()) is (path == GPU)  # `make image-test` builds and runs the CPU one


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for i, a in instructions(path):
        if i == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((i, a))
    return stages


def test_cpu_image_runs_from_a_stage_without_compilers_or_dev_extras() -> None:
    """The builder compiles llama.cpp; the runtime stage installs Python alone and copies /app from it.
    `make image-test` checks the built image itself (no gcc, cmake, git, pytest in it)."""
    builder, runtime = _stages(CPU)
    assert builder[0] == ("FROM", "${BASE_IMAGE} AS builder") and runtime[0] == ("FROM", "${BASE_IMAGE}")
    apt = lambda stage: " ".join(a for i, a in stage if i == "RUN" and "apt-get install" in a)  # noqa: E731
    assert {"build-essential", "cmake"} <= set(apt(builder).split())
    assert not {"build-essential", "cmake", "git", "gcc", "g++", "make"} & set(apt(runtime).split())
    assert ("COPY", "--from=builder /app /app") in runtime
    setup = next(a for i, a in builder if i == "RUN" and "make setup" in a)
    assert "EXTRAS=" in setup.split() and "PIP_NO_CACHE_DIR=1" in next(a for i, a in builder if i == "ENV")


def test_cpu_image_builds_llama_cpp_before_the_code_and_for_any_cpu() -> None:
    """A change to the code reuses the layers of the dependencies and of llama.cpp, which is built
    portable (ggml's runtime CPU dispatch), not for the build machine."""
    builder = _stages(CPU)[0]
    copies = [(n, a) for n, (i, a) in enumerate(builder) if i == "COPY"]
    llama = next(n for n, (i, a) in enumerate(builder) if i == "RUN" and "install_llamacpp.py" in a)
    whole = next(n for n, a in copies if a == ". .")
    assert [a for n, a in copies if n < llama] == ["pyproject.toml ./", "build/install_llamacpp.py build/llamacpp_patch.py build/",
                                                    "build/llamacpp_kernels build/llamacpp_kernels"]
    # exactly what make setup's own build depends on (its stamp's prerequisites)
    stamp = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("$(STAMP):"))
    assert (stamp.split(":", 1)[1].strip()
            == "pyproject.toml build/install_llamacpp.py build/llamacpp_patch.py $(wildcard build/llamacpp_kernels/*)")
    assert llama < whole and "LLAMA_CPP_BUILD=portable" in next(a for i, a in builder if i == "ENV")


def test_cpu_image_base_is_pinned_by_digest() -> None:
    """The base is an ARG that the build refuses unless it names a digest (`make image` passes one)."""
    ins = instructions(CPU)
    assert ins[0] == ("ARG", "BASE_IMAGE") and [a for i, a in ins if i == "FROM"] == ["${BASE_IMAGE} AS builder", "${BASE_IMAGE}"]
    check = next(a for i, a in _stages(CPU)[0] if i == "RUN" and "BASE_IMAGE" in a)
    for ref, ok in [("debian:bookworm-slim", False), ("localhost/specgate-debian:bookworm-minbase@sha256:" + "ab" * 32, True)]:
        script = check.replace('"$BASE_IMAGE"', f'"{ref}"')
        assert (subprocess.run(["sh", "-c", script], capture_output=True).returncode == 0) is ok, ref


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
                         replicas=[ReplicaRecord(name="replica-1", ports=PortSet(**vars(ports)), tritonserver_pid=3, front_pid=4,
                                                 status="ready")])
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


def _secret(path: str) -> bool:
    """What must never reach an image: keys, certificates, a host's environment or repository, the
    server's own artifacts (artifacts/secrets among them), the Secret's files for Kubernetes."""
    parts = Path(path).parts
    return path.endswith((".key", ".pem")) or Path(path).name == ".env" or bool({"secrets", ".venv", ".git", "artifacts"} & set(parts))


def _used_checkout(root: Path) -> Path:
    """This checkout's .dockerignore in a tree as a user's looks after `make setup`, `make serve` and
    the Kubernetes secrets step: what `COPY . /app` must and must not take."""
    shutil.copy(ROOT / ".dockerignore", root / ".dockerignore")
    needed = ["pyproject.toml", "Makefile", "build/install_llamacpp.py", "python_backend/specgate/machine.py",
              "heads/smollm2-135m-eagle/config.json", "policy/default.yaml", "deploy/k8s/base/secrets/README.md"]
    secret = ["artifacts/secrets/admin.key", "artifacts/secrets/label.key", "artifacts/secrets/engine.key",
              "artifacts/model_repository/llm/config.pbtxt", "deploy/k8s/base/secrets/admin.key", "deploy/k8s/base/secrets/tenants.yaml",
              ".venv/.installed", ".git/config", "my.pem", "policy/.env", "python_backend/specgate/__pycache__/machine.cpython-311.pyc"]
    for name in needed + secret:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    os.symlink("/usr/bin/python3", root / ".venv" / "python")  # the link that failed the build inside the image
    return root


def test_the_build_context_of_a_used_checkout_holds_no_secret(tmp_path: Path) -> None:
    files = context_files(_used_checkout(tmp_path))
    assert {"pyproject.toml", "build/install_llamacpp.py", "python_backend/specgate/machine.py",
            "heads/smollm2-135m-eagle/config.json"} <= files
    assert not [f for f in files if _secret(f) or "__pycache__" in f]


def test_this_checkouts_build_context_holds_no_secret() -> None:
    files = context_files(ROOT)
    assert "python_backend/specgate_deploy/pod.py" in files and "pyproject.toml" in files
    assert not [f for f in files if _secret(f)]


@pytest.mark.parametrize(
    "rules, path, excluded",
    [
        ("artifacts", "artifacts/secrets/admin.key", True),  # a folder takes what is under it
        ("/artifacts", "artifacts/x", True),  # a leading / is the context's root
        ("artifacts", "build/artifacts.py", False),
        ("**/*.key", "admin.key", True),  # ** is any number of folders, none included
        ("**/*.key", "a/b/c.key", True),
        ("*.key", "a/c.key", False),  # * stays within one folder
        ("**/secrets", "deploy/k8s/base/secrets/README.md", True),
        ("docs\n!docs/keep.md", "docs/keep.md", False),  # ! takes a file back, the last match decides
        ("docs\n!docs/keep.md", "docs/other.md", True),
        ("!docs/keep.md\ndocs", "docs/keep.md", True),
        ("a?c", "abc", True),
        ("a?c", "a/c", False),
        ("# a comment\n\n  results  ", "results/x.md", True),
    ],
)
def test_dockerignore_rules_as_the_builder_reads_them(rules: str, path: str, excluded: bool) -> None:
    assert DockerIgnore(rules).excluded(path) is excluded
