"""The container's entrypoint (deploy/Dockerfile): one replica on the usual ports, drained on SIGTERM.

- Secrets: Kubernetes mounts the Secret's files readable by the pod's group (0440 with an fsGroup),
  and the server refuses secret files others may read (specgate.secret_file). So the admin and
  label keys are copied from the mount into artifacts/secrets/ (0600, this user's) at start. The
  tenant key file stays in the mount, where the policy names it, so key rotation needs no restart.
- A tritonserver that dies ends the container (exit 1) instead of being restarted here: the kubelet
  restarts it and counts the restart, where an operator sees it.
- SIGTERM: tritonserver stops taking requests, finishes those in flight for up to --drain-s, exits;
  then the front stops (replica.py). terminationGracePeriodSeconds covers preStop + drain.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import specgate_launcher as launcher
from specgate_deploy.replica import DRAIN_S, Replica

SECRETS_MOUNT = Path("/etc/specgate/secrets")


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


def trtllm_server(spec_path: Path):  # noqa: ANN201 (a factory of Replica.server_factory's type)
    """The tensorrtllm repository's server (build/trtllm/serve.py), engines built first if missing."""
    from build.trtllm.serve import server_command, server_env
    from build.trtllm.spec import load_spec

    spec = load_spec(spec_path, launcher.ROOT)
    # Engines need the node's GPU, so they are built at the start. The build skips the steps whose
    # outputs exist (docs/trtllm.md), so a restart only re-renders the repository over the CPU one.
    subprocess.run([sys.executable, "-m", "build.build_engines", "--engine", "trtllm", "--spec", str(spec_path)], cwd=launcher.ROOT, check=True)

    def start(repo: Path, ports: launcher.Ports, log_file: Path, extra: list[str], admin_header: str) -> subprocess.Popen:  # noqa: ARG001 (no admin key flags in this command)
        cmd = server_command(repo, ports, spec.parallel.gpus) + extra
        out = open(log_file, "w")
        return subprocess.Popen(cmd, env={**os.environ, **server_env(launcher.ROOT)}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    return start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=launcher.ROOT / "artifacts" / "model_repository")
    ap.add_argument("--secrets", type=Path, default=SECRETS_MOUNT, help="the mounted Secret (admin.key, label.key)")
    ap.add_argument("--drain-s", type=int, default=int(os.environ.get("DRAIN_S", DRAIN_S)))
    ap.add_argument("--engine", choices=["cpu", "trtllm"], default="cpu")
    ap.add_argument("--spec", type=Path, default=Path("build/specs/smollm2-eagle.yaml"), help="TensorRT-LLM build spec (--engine trtllm)")
    ap.add_argument("--log-dir", type=Path, default=launcher.ROOT / "artifacts" / "logs")
    args = ap.parse_args(argv)
    print(f"[pod] secrets from {args.secrets}: {', '.join(install_secrets(args.secrets)) or 'none (created at first start)'}", flush=True)
    name = os.environ.get("POD_NAME", socket.gethostname())
    env = lambda k, d: int(os.environ.get(k, d))  # noqa: E731 (the launcher's port variables)
    ports = launcher.Ports(env("HTTP_PORT", 8000), env("GRPC_PORT", 8001), env("METRICS_PORT", 8002), env("FRONT_PORT", 9000))
    replica = Replica(name, ports, args.model_repository, args.log_dir, args.drain_s, restart_on_exit=False)
    if args.engine == "trtllm":
        replica.server_factory = trtllm_server(args.spec)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    replica.start()
    code = 0
    while not stop.wait(1.0):
        if replica.server is not None and replica.server.poll() is not None:
            print(f"[pod] tritonserver exited with code {replica.server.returncode}; the container ends (the kubelet restarts it)", flush=True)
            code = 1
            break
        replica.poll()
    t0 = time.monotonic()
    if code == 0:
        print(f"[pod] SIGTERM: draining (up to {args.drain_s} s)", flush=True)
    replica.begin_drain()
    replica.finish_drain(time.monotonic() + args.drain_s + 5)
    print(f"[pod] stopped after {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
