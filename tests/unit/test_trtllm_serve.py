"""The NGC server command (orchestrator mode, as launch_triton_server.py --multi-model) and the smoke's
metrics parsing."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from build.gpu_smoke import parse_metrics
from build.trtllm.serve import server_command, server_env
from specgate.launcher import Ports


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


def test_parse_metrics_sums_labels() -> None:
    text = "\n".join([
        "# HELP spec_gate_decisions_total decisions",
        'spec_gate_decisions_total{route="speculative",reason="header"} 2',
        'spec_gate_decisions_total{route="baseline",reason="header"} 3',
        "spec_decode_num_draft_tokens_total 40",
        "spec_decode_num_accepted_tokens_total 17",
        'nv_inference_count{model="llm",version="1"} 5',
    ])  # fmt: skip
    m = parse_metrics(text)
    assert m["spec_gate_decisions_total"] == 5 and m["decisions_speculative"] == 2
    assert m["spec_decode_num_draft_tokens_total"] == 40 and m["spec_decode_num_accepted_tokens_total"] == 17
    assert m["spec_decode_num_drafts_total"] == 0
