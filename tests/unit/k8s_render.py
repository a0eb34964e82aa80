"""Render deploy/k8s's overlays offline, as `kubectl apply -k` would, for the manifest tests.

The renderer is real kustomize: a `kustomize` binary where one is on PATH, else the one built into
`kubectl` (`kubectl kustomize`; the project's machine image ships kubectl 1.32 with kustomize v5.5).
Neither is a package of the registries these machines reach (Debian's kubernetes-client is 1.20,
whose kustomize v2 predates `patches` and `labels`), so without both the tests skip, saying so.
The tree is copied first so that the Secret's files, which are never committed, can be made for it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(overlay: str, tmp: Path) -> list[dict]:
    from specgate_deploy.k8s_secrets import make_secrets

    cmd = kustomize_command()
    assert cmd is not None
    tree = tmp / "k8s"
    if not tree.exists():
        shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("*.key", "tenants.yaml"))
        make_secrets(tree / "base" / "secrets")
    out = subprocess.run([*cmd, str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]
