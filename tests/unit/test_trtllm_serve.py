"""The NGC server command (orchestrator mode, as launch_triton_server.py --multi-model)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from build.trtllm.serve import server_command, server_env
from specgate_launcher import Ports


def test_server_command_matches_the_multi_model_launch() -> None:
    cmd = server_command(Path("/repo"), Ports(8000, 8001, 8002), gpus=2)
    assert cmd[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]  # world size 1: workers are spawned
    assert cmd[4] == "/opt/tritonserver/bin/tritonserver"
    for flag in ("--model-repository=/repo", "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                 "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0",
                 "--backend-config=python,shm-region-prefix-name=prefix0_", "--disable-auto-complete-config",
                 "--http-header-forward-pattern=x-.*", "--grpc-header-forward-pattern=x-.*", "--metrics-port=8002"):  # fmt: skip
        assert flag in cmd
    env = server_env(Path("/src"))
    assert env["TRTLLM_ORCHESTRATOR"] == "1" and env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "1"
    assert env["SPECGATE_PYTHONPATH"].split(os.pathsep)[0] == "/src/python_backend"
    assert sysconfig.get_paths()["purelib"] in env["SPECGATE_PYTHONPATH"].split(os.pathsep)
