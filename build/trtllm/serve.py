"""The tritonserver command for the tensorrtllm repository in the NGC image.

Two tensorrtllm models (target_engine, spec_engine) in one repository need the backend's orchestrator
mode, what triton_backend/scripts/launch_triton_server.py does for `--multi-model`:
TRTLLM_ORCHESTRATOR=1, spawned workers (a model with tp*pp > 1 gets its ranks spawned on its
`gpu_device_ids`), no pinned/CUDA memory pools, no peer access, and a per-rank python shm prefix. On
top, what the CPU server has too (specgate_launcher): the gate's header forwarding, the project's ports,
the control APIs behind the admin key, explicit model control (the supervisor reloads a dead
spec_engine through it, specgate_deploy.health), and the engine and label keys.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from build.trtllm.spec import ParallelSpec
from specgate.gate.labels import LABEL_KEY_ENV
from specgate.serving.engine_key import ENGINE_KEY_ENV
from specgate_launcher import ENGINE_SECRET, HEADER_PATTERN, LABEL_SECRET, ROOT, Ports

TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # launch_triton_server.py's default


def server_env(repo_root: Path) -> dict[str, str]:
    """Environment additions: orchestrator mode, and where the Python-backend models import specgate and its
    dependencies from (this interpreter's site-packages, as specgate_launcher does; the image's stub is the
    same Python version as a venv made from the image's python3). Unlike the launcher it leaves
    LD_LIBRARY_PATH alone: the image's CUDA libraries must win."""
    paths = [str(repo_root / "python_backend"), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return {
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1",
        "SPECGATE_PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        # spec_gate signs a CPU engine's requests with it; and the secret of the gate's tenant labels,
        # the same on every pod (without it each process picks its own). The caller creates both files
        # (specgate_launcher.ensure_secrets).
        ENGINE_KEY_ENV: str(repo_root / ENGINE_SECRET.relative_to(ROOT)),
        LABEL_KEY_ENV: str(repo_root / LABEL_SECRET.relative_to(ROOT)),
    }


def server_command(
    repo: Path, ports: Ports, parallel: ParallelSpec, restricted: Sequence[str] = (), tritonserver: str = TRITONSERVER
) -> list[str]:
    """`restricted`: specgate_launcher.restricted_api_args. A model of world size 1 (tp x pp = 1) is
    served by tritonserver itself, so that a SIGTERM reaches it and it drains; a larger one starts under
    `mpirun -n 1`, as launch_triton_server.py does, whose ranks are spawned (a drain there goes through
    mpirun)."""
    launch = ["mpirun", "--allow-run-as-root", "-n", "1"] if parallel.world_size > 1 else []
    return [
        *launch,
        tritonserver,
        f"--model-repository={repo}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        f"--http-header-forward-pattern={HEADER_PATTERN}",
        f"--grpc-header-forward-pattern={HEADER_PATTERN}",
        # launch_triton_server.py add_multi_model_config(): spawned workers own the GPUs
        "--pinned-memory-pool-byte-size=0",
        "--enable-peer-access=false",
        *[f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(parallel.gpus)],
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
        "--model-control-mode=explicit",
        "--load-model=*",
        *restricted,
    ]  # fmt: skip
