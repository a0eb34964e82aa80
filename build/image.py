"""`make image`: the CPU image (deploy/Dockerfile), built with podman from Debian's own packages.

    python3 build/image.py setup   # as root, once a machine: podman, runc, debootstrap; podman's config
    python3 build/image.py build   # make image: the base if missing, then the image; its size and build time

- podman runs with runc and cgroupfs: crun fails on these hosts' hybrid cgroups, and the default
  ulimits cannot be set there (`default_ulimits = []` in containers.conf).
- The base is Debian 12 made here (`debootstrap --variant=minbase bookworm`, then `podman import`), so
  no image registry is needed. deploy/Dockerfile takes it by digest (BASE_IMAGE=name@sha256:...).
- pip in the RUN steps reaches the package index only with the CA bundle that this machine's pip
  configuration names, and resolves torch to its CPU build only with the local wheel folders it names
  (`pip config list`). Both are mounted read-only into the RUN steps (`podman build --volume`),
  never into a layer.
- build/install_llamacpp.py's wheel cache is a folder of this machine's, mounted: a wheel that an
  earlier image build compiled (same version, arguments and patch) is installed instead of compiled
  again (ten minutes and more), e.g. after the base was made anew. A folder of its own, apart from
  `make setup`'s: a wheel compiled on the host could need a newer C library than the image's.

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
BASE = "localhost/specgate-debian:bookworm-minbase"
IMAGE = os.environ.get("IMAGE", "localhost/specgate:cpu")
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PIP_MOUNT = "/opt/pip"  # where the RUN steps see the CA bundle and the wheel folders
WHEEL_CACHE = Path.home() / ".cache" / "specgate" / "image-wheels"


def writable_dirs() -> list[str]:
    """The folders the image lets the server write (its Dockerfile's `mkdir -p` line): emptyDirs in the
    pod, whose root filesystem is read-only (test_deploy_k8s keeps the two equal), tmpfs in image-test."""
    line = next(ln for ln in DOCKERFILE.read_text().replace("\\\n", " ").splitlines() if ln.startswith("RUN mkdir -p "))
    return [f"/app/{d}" for d in line.removeprefix("RUN mkdir -p ").split("&&")[0].split()]


def log(msg: str) -> None:
    print(f"[image] {msg}", flush=True)


def podman(*args: str, capture: bool = False) -> str:
    out = subprocess.run([*PODMAN, *args], check=True, text=True, stdout=subprocess.PIPE if capture else None)
    return (out.stdout or "").strip()


def setup() -> None:
    """Debian's podman, runc and debootstrap, and the ulimits setting (as root; `.ci/run` calls this)."""
    if os.geteuid() != 0:
        raise SystemExit("[image] setup needs root: apt-get install podman runc debootstrap")
    if not all(shutil.which(t) for t in ("podman", "runc", "debootstrap")):
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "podman", "runc", "debootstrap"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)
    text = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
    if "default_ulimits" not in text:
        if "[containers]" in text:
            text = text.replace("[containers]", "[containers]\ndefault_ulimits = []", 1)
        else:
            text += "\n[containers]\ndefault_ulimits = []\n"
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(text)
        log(f"{CONTAINERS_CONF}: default_ulimits = []")


def base() -> str:
    """The base image by digest, made from Debian's packages first if this machine has none."""
    if subprocess.run([*PODMAN, "image", "exists", BASE]).returncode != 0:
        if os.geteuid() != 0 or not shutil.which("debootstrap"):
            raise SystemExit(f"[image] no base image {BASE}: making it needs root and debootstrap (python3 build/image.py setup)")
        log(f"making {BASE} with debootstrap (about a minute)")
        with tempfile.TemporaryDirectory(prefix="specgate-base-") as tree:
            subprocess.run(["debootstrap", "--variant=minbase", "bookworm", tree], check=True, stdout=subprocess.DEVNULL)
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # fetched again by the image's apt-get update
                for f in Path(tree, cache).glob("*"):
                    if f.is_file():
                        f.unlink()
            tar = subprocess.Popen(["tar", "-C", tree, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run([*PODMAN, "import", "-", BASE], stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
            if tar.wait() != 0:
                raise SystemExit("[image] tar of the Debian tree failed")
    return f"{BASE}@{podman('image', 'inspect', '--format', '{{.Digest}}', BASE, capture=True)}"


def pip_files() -> tuple[Path | None, list[Path]]:
    """The CA bundle and the local wheel folders this machine's pip configuration names (the
    environment's settings win over the files', as in pip)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip().strip("'\"")
    cert = values.get(":env:.cert") or values.get("global.cert")
    links = (values.get(":env:.find-links") or values.get("global.find-links") or "").split()
    return (Path(cert) if cert and Path(cert).is_file() else None), [Path(d) for d in links if Path(d).is_dir()]


def build(tag: str = IMAGE) -> float:
    """Build the image (layers cached from earlier builds are reused); returns the seconds it took."""
    base_ref = base()
    cert, wheels = pip_files()
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    mounts, args = ["--volume", f"{WHEEL_CACHE}:/root/.cache/specgate/wheels"], [f"BASE_IMAGE={base_ref}"]
    if cert:
        mounts += ["--volume", f"{cert}:{PIP_MOUNT}/ca.pem:ro"]
        args.append(f"PIP_CERT={PIP_MOUNT}/ca.pem")
    for i, d in enumerate(wheels):
        mounts += ["--volume", f"{d}:{PIP_MOUNT}/wheels-{i}:ro"]
    if wheels:
        args.append("PIP_FIND_LINKS=" + " ".join(f"{PIP_MOUNT}/wheels-{i}" for i in range(len(wheels))))
    log(f"building {tag} from {base_ref} (pip: CA bundle {cert or 'none'}, wheel folders {[str(w) for w in wheels] or 'none'})")
    start = time.monotonic()
    build_args = [a for arg in args for a in ("--build-arg", arg)]
    # the docker format: OCI's has no HEALTHCHECK
    podman("build", "--format", "docker", "--network", "host", "--pull=never", "--layers", *mounts, *build_args,
           "-f", str(DOCKERFILE), "-t", tag, str(ROOT))
    took = time.monotonic() - start
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag, capture=True))
    log(f"{tag}: {size / 1e9:.2f} GB, built in {took:.0f} s")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["setup", "build"])
    args = ap.parse_args()
    if args.step == "setup":
        setup()
    else:
        if not shutil.which("podman"):
            raise SystemExit("[image] podman not found: apt-get install podman runc debootstrap "
                             "(or, as root, python3 build/image.py setup)")
        build()


if __name__ == "__main__":
    main()
