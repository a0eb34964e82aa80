"""The NGC server command (orchestrator mode, as launch_triton_server.py --multi-model) and the GPU pod's
server: what the CPU server has too (admin key, explicit model control, engine and label keys)."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

import specgate_launcher as launcher
from build.trtllm.serve import server_command, server_env
from build.trtllm.spec import ParallelSpec
from specgate.secret_file import read_secret
from specgate_launcher import Ports


def test_server_command_matches_the_multi_model_launch() -> None:
    cmd = server_command(Path("/repo"), Ports(8000, 8001, 8002), ParallelSpec(gpus=2), ["--http-restricted-api=x"])
    assert cmd[0] == "/opt/tritonserver/bin/tritonserver"  # world size 1: SIGTERM reaches tritonserver, not mpirun
    for flag in ("--model-repository=/repo", "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                 "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0",
                 "--backend-config=python,shm-region-prefix-name=prefix0_", "--disable-auto-complete-config",
                 "--http-header-forward-pattern=x-.*", "--grpc-header-forward-pattern=x-.*", "--metrics-port=8002",
                 "--model-control-mode=explicit", "--load-model=*", "--http-restricted-api=x"):  # fmt: skip
        assert flag in cmd
    ranks = server_command(Path("/repo"), Ports(8000, 8001, 8002), ParallelSpec(tp_size=2, gpus=2))
    assert ranks[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "/opt/tritonserver/bin/tritonserver"]  # spawned ranks
    env = server_env(Path("/src"))
    assert env["TRTLLM_ORCHESTRATOR"] == "1" and env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "1"
    assert env["SPECGATE_PYTHONPATH"].split(os.pathsep)[0] == "/src/python_backend"
    assert sysconfig.get_paths()["purelib"] in env["SPECGATE_PYTHONPATH"].split(os.pathsep)
    assert (env["SPECGATE_ENGINE_KEY_FILE"] == "/src/artifacts/secrets/engine.key"
            and env["SPECGATE_LABEL_KEY_FILE"] == "/src/artifacts/secrets/label.key")


def test_the_gpu_pods_server_has_its_keys_and_the_admin_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: no engine key (spec_gate and postprocessing failed to load), no admin flags, no model control."""
    from specgate_deploy import pod

    secrets = tmp_path / "secrets"
    for name in ("SECRETS", "ADMIN_SECRET", "LABEL_SECRET", "ENGINE_SECRET"):
        monkeypatch.setattr(launcher, name, secrets / getattr(launcher, name).name if name != "SECRETS" else secrets)
    started = {}
    monkeypatch.setattr(pod.subprocess, "Popen", lambda cmd, env, **kw: started.update(cmd=cmd, env=env))
    start = pod.trtllm_server(launcher.ROOT / "build" / "specs" / "smollm2-eagle.yaml")
    start(Path("/repo"), Ports(), tmp_path / "log", ["--exit-timeout-secs=60"], "ops-key")
    assert {p.name for p in secrets.iterdir()} == {"admin.key", "label.key", "engine.key"}
    key = read_secret(secrets / "admin.key")
    assert started["cmd"][0].endswith("tritonserver") and "--exit-timeout-secs=60" in started["cmd"]
    assert f"--http-restricted-api=model-repository,shared-memory,logging,trace:ops-key={key}" in started["cmd"]
    assert "--model-control-mode=explicit" in started["cmd"] and "SPECGATE_LABEL_KEY_FILE" in started["env"]


def test_the_gpu_init_container_builds_per_gpu_model_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specgate_deploy import pod

    calls = []
    monkeypatch.setattr(pod, "gpu_model", lambda: "NVIDIA_A10G")
    monkeypatch.setattr(pod.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    pod.main(["--engine", "trtllm", "--build-only", "--engine-cache", str(tmp_path / "engines"),
              "--model-repository", str(tmp_path / "served" / "model_repository")])
    cmd = calls[0]
    assert (cmd[cmd.index("--artifacts") + 1] == str(tmp_path / "engines" / "NVIDIA_A10G")
            and cmd[cmd.index("--out-dir") + 1] == str(tmp_path / "served"))
    with pytest.raises(SystemExit, match="model_repository"):
        pod.main(["--engine", "trtllm", "--build-only", "--engine-cache", str(tmp_path), "--model-repository", str(tmp_path / "repo")])
