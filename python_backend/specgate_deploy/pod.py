"""The container's entrypoint (deploy/Dockerfile): one replica on the usual ports, drained on SIGTERM.

- Secrets: Kubernetes mounts the Secret's files readable by the pod's group (0440 with an fsGroup),
  and the server refuses secret files others may read (specgate.secret_file). So the admin and
  label keys are copied from the mount into artifacts/secrets/ (0600, this user's) at start. The
  tenant key file stays in the mount, where the policy names it, so key rotation needs no restart.
- A tritonserver that dies ends the container (exit 1) instead of being restarted here: the kubelet
  restarts it and counts the restart, where an operator sees it.
- SIGTERM: tritonserver stops taking requests, finishes those in flight for up to --drain-s, exits;
  then the front stops (replica.py). terminationGracePeriodSeconds covers preStop + worst_stop_s.
- GPU (deploy/Dockerfile.gpu): `--build-only` is the initContainer, which builds the TensorRT-LLM
  engines for the node's GPU model into a volume that keeps them and renders their repository; the
  server then serves that repository.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import specgate_launcher as launcher
from specgate.secret_file import read_secret
from specgate_deploy import health
from specgate_deploy import replica as replica_mod
from specgate_deploy.replica import DRAIN_S, EXIT_S, Replica

SECRETS_MOUNT = Path("/etc/specgate/secrets")
# The supervision step in flight when SIGTERM comes, at its longest before a full drain: a look at the
# models (the repository index, then the engines pinged at once). A look that stops a server that
# cannot serve (no restarts in a container) leaves nothing to drain after it.
STEP_S = replica_mod.LOOK_TIMEOUT_S + health.PING_TIMEOUT_S


def worst_stop_s(drain_s: float) -> float:
    """From SIGTERM to this process's exit, at the longest the code allows."""
    return STEP_S + replica_mod.worst_stop_s(drain_s)


def install_secrets(src: Path, names: tuple[str, ...] = (launcher.ADMIN_SECRET.name, launcher.LABEL_SECRET.name)) -> list[str]:
    """Copy the mounted secrets the server reads by path into artifacts/secrets, mode 0600."""
    launcher.SECRETS.mkdir(mode=0o700, parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (src / name).is_file():
            dst = launcher.SECRETS / name
            tmp = dst.with_suffix(".tmp")
            shutil.copyfile(src / name, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, dst)
            copied.append(name)
    return copied


def gpu_model() -> str:
    """The node's GPU model as a folder name: a TensorRT-LLM engine runs on the model it was built on."""
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
    return re.sub(r"[^A-Za-z0-9._-]+", "_", names.splitlines()[0].strip())


def build_trtllm(spec_path: Path, cache: Path, repo: Path) -> None:
    """The GPU pod's initContainer: the engines for this node's GPU model and the spec, under
    `cache`/<GPU model>/trtllm/<spec name> (a volume that keeps them: a later pod or a restart finds
    them, as the build skips the steps whose outputs exist and refuses another spec under the same
    name), and the repository that serves them rendered at `repo` (its folder must be model_repository)."""
    if repo.name != "model_repository":
        raise SystemExit(f"[pod] {repo}: the repository is rendered into a folder named model_repository")
    folder = cache / gpu_model()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as lock:  # pods starting together on a shared volume: one builds
        fcntl.flock(lock, fcntl.LOCK_EX)
        cmd = [sys.executable, "-m", "build.build_engines", "--engine", "trtllm", "--spec", str(spec_path), "--artifacts", str(folder),
               "--out-dir", str(repo.parent)]
        subprocess.run(cmd, cwd=launcher.ROOT, check=True)


def trtllm_server(spec_path: Path):  # noqa: ANN201 (a factory of Replica.server_factory's type)
    """The tensorrtllm repository's server (build/trtllm/serve.py), on engines built by build_trtllm."""
    from build.trtllm.serve import server_command, server_env
    from build.trtllm.spec import load_spec

    spec = load_spec(spec_path, launcher.ROOT)

    def start(repo: Path, ports: launcher.Ports, log_file: Path, extra: list[str], admin_header: str) -> subprocess.Popen:
        launcher.ensure_secrets()
        restricted = launcher.restricted_api_args(admin_header, read_secret(launcher.ADMIN_SECRET))
        cmd = server_command(repo, ports, spec.parallel, restricted) + extra
        out = open(log_file, "w")
        return subprocess.Popen(cmd, env={**os.environ, **server_env(launcher.ROOT)}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    return start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=launcher.ROOT / "artifacts" / "model_repository")
    ap.add_argument("--secrets", type=Path, default=SECRETS_MOUNT, help="the mounted Secret (admin.key, label.key)")
    ap.add_argument("--drain-s", type=int, default=int(os.environ.get("DRAIN_S", DRAIN_S)))
    ap.add_argument("--engine", choices=["cpu", "trtllm"], default="cpu")
    ap.add_argument("--spec", type=Path, default=Path("build/specs/smollm2-eagle.yaml"), help="TensorRT-LLM build spec (--engine trtllm)")
    ap.add_argument("--engine-cache", type=Path, default=Path("/engines"),
                    help="where --build-only keeps the engines, by GPU model (--engine trtllm)")
    ap.add_argument("--build-only", action="store_true",
                    help="build the TensorRT-LLM engines and render --model-repository, then exit (the GPU pod's initContainer)")
    ap.add_argument("--log-dir", type=Path, default=launcher.ROOT / "artifacts" / "logs")
    args = ap.parse_args(argv)
    if args.build_only:
        if args.engine != "trtllm":
            raise SystemExit("[pod] --build-only builds TensorRT-LLM engines: --engine trtllm")
        build_trtllm(args.spec, args.engine_cache, args.model_repository)
        return
    print(f"[pod] secrets from {args.secrets}: {', '.join(install_secrets(args.secrets)) or 'none (created at first start)'}", flush=True)
    name = os.environ.get("POD_NAME", socket.gethostname())
    env = lambda k, d: int(os.environ.get(k, d))  # noqa: E731 (the launcher's port variables)
    ports = launcher.Ports(env("HTTP_PORT", 8000), env("GRPC_PORT", 8001), env("METRICS_PORT", 8002), env("FRONT_PORT", 9000))
    replica = Replica(name, ports, args.model_repository, args.log_dir, args.drain_s, restart_on_exit=False)
    if args.engine == "trtllm":
        if not (args.model_repository / "llm" / "config.pbtxt").exists():  # no initContainer rendered it: run alone
            build_trtllm(args.spec, args.engine_cache, args.model_repository)
        replica.server_factory = trtllm_server(args.spec)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    replica.start()
    code = 0
    while not stop.wait(1.0):
        if replica.server is not None and replica.server.poll() is not None:
            print(f"[pod] tritonserver exited with code {replica.server.returncode}; the container ends (the kubelet restarts it)",
                  flush=True)
            code = 1
            break
        replica.poll()
    t0 = time.monotonic()
    if code == 0:
        print(f"[pod] SIGTERM: draining (up to {args.drain_s} s)", flush=True)
    replica.begin_drain()
    replica.finish_drain(time.monotonic() + args.drain_s + EXIT_S)
    print(f"[pod] stopped after {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
