"""Shared fixtures. Integration tests run against ONE real tritonserver per session, started here on
ports 18000-18002 (so a `make serve` on the default ports can keep running), on the default engine
(llama.cpp) with the EAGLE head in fp32.

Its spec_engine's calibration is pinned to a flat cost curve (verification free at any size) and
free drafting, so every step drafts the request's full k, as the serving behaviour these tests check
needs; test_calibration.py swaps measurements through the control message and puts these back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specgate.algorithms import SPEC_ALGORITHMS
from specgate.decoding.compute_lock import ENV as ENV_COMPUTE_LOCK

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "artifacts" / "checkpoints" / "smollm2-135m-instruct"
DRAFT = CHECKPOINT.parent / "smollm2-135m-draft"  # written by `make build-engines ENGINE=torch` (and the tests)
GGUF = ROOT / "artifacts" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the shipped model, llama.cpp's input
DRAFT_GGUF = GGUF.with_name("SmolLM2-135M-Instruct.Q4_1.draft-4L.gguf")  # written by `make build-engines`
HEAD = ROOT / "heads" / "smollm2-135m-eagle"  # the shipped EAGLE head
TEST_OUT = ROOT / "artifacts" / "test-fp32"
TEST_POLICY = TEST_OUT / "policy.yaml"
FREE_DRAFTING = json.dumps({"cost_ratios": {"1": 1.0, "32": 1.0}, "draft_ms": {a: 0.0 for a in SPEC_ALGORITHMS}})
# ... with its scale pinned too: nothing is left to measure, so spec_engine publishes at once instead of
# waiting for a quiet machine (two replicas on one machine each waited 30 s for the other, issue 28),
# also after test_gate_failover reloads it. The suite's servers; what they measure when asked is
# test_calibration's, and a repository rendered without an override (test_user_gguf) measures at load.
PINNED_DRAFTING = json.dumps({**json.loads(FREE_DRAFTING), "base_ms": 10.0})
TEST_KEYS = TEST_OUT / "tenants.yaml"  # the key file TEST_POLICY names
# The test server's engines take turns on a lock of their own, not the machine's: a test that holds it
# makes them slow (test_gate_failover, the soak) without slowing another server on the machine.
COMPUTE_LOCK = TEST_OUT / "compute.lock"


def stub_pids(model: str) -> set[int]:
    """Python-backend stub processes of `model` in this suite's server only: other servers on the
    machine (a `make serve`, another checkout's tests) run stubs of the same models."""
    out = subprocess.run(["pgrep", "-af", "triton_python_backend_stub"], capture_output=True, text=True).stdout
    ours = f" {TEST_OUT / 'model_repository' / model}/"
    return {int(line.split()[0]) for line in out.splitlines() if ours in line}


def require_checkpoint() -> Path:
    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.fail(f"no checkpoint at {CHECKPOINT}: run `make build-engines` (make test does it first)")
    return CHECKPOINT


@pytest.fixture(scope="module", autouse=True)
def torch_threads() -> None:
    """Each module starts with torch's own thread count: loading a llama.cpp target sets one for the
    whole process (decoding/loading.py), which would slow the PyTorch-only modules after it."""
    import torch

    from specgate.decoding.loading import TORCH_THREADS

    torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return require_checkpoint()


@pytest.fixture(scope="session")
def gguf() -> Path:
    if not GGUF.exists():
        pytest.fail(f"no GGUF at {GGUF}: run `make build-engines` (make test does it first)")
    return GGUF


@pytest.fixture(scope="session")
def server(checkpoint: Path):
    """A real tritonserver on the rendered fp32 repository; yields its Ports."""
    from specgate_launcher import Ports, running, wait_calibrated

    TEST_OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "tests" / "integration" / "policy.yaml", TEST_POLICY)  # tests edit these copies live
    shutil.copy(ROOT / "tests" / "integration" / "tenants.yaml", TEST_KEYS)
    subprocess.run(
        [sys.executable, "-m", "build.build_engines", "--dtype", "float32", "--out-dir", str(TEST_OUT), "--policy", str(TEST_POLICY),
         "--calibration-override", PINNED_DRAFTING],  # test_calibration measures through this server
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )
    ports = Ports(int(os.environ.get("TEST_HTTP_PORT", 18000)), int(os.environ.get("TEST_GRPC_PORT", 18001)),
                  int(os.environ.get("TEST_METRICS_PORT", 18002)))
    os.environ[ENV_COMPUTE_LOCK] = str(COMPUTE_LOCK)  # the launcher keeps a lock path it is given
    log = TEST_OUT / "tritonserver.log"
    # 3 s to stop, not Triton's 30: after test_gate_failover has killed engines mid-request, spec_gate's
    # stub never unloads (docs/robustness.md, "Limits") and the server would wait out the whole timeout.
    # Requests still in flight are logged from the first second of the stop, which is all the check
    # below reads.
    with running(TEST_OUT / "model_repository", ports, log, extra=["--exit-timeout-secs=3"]):
        wait_calibrated(TEST_OUT / "model_repository")  # until then the gate routes to the baseline (`calibrating`)
        yield ports
    # Every request the suite sent must have ended inside Triton too: a request that the ensemble
    # never completes (a step's error while other steps of it ran: serving/watch.py) is
    # seen only here, in what tritonserver logs while it stops.
    stuck = re.findall(r"Model '(\w+)' \(version \d+\) has (\d+) in-flight inferences", log.read_text(errors="replace"))
    assert not stuck, f"tritonserver stopped with requests still in flight (model, count): {stuck[-1]}"


LIVE_TIMEOUT_S = 120  # a 1-token request takes well under a second; silence this long: the server is wedged
_wedged: list[str] = []  # the test before which the session's server stopped answering


@pytest.fixture(autouse=True)
def session_server_answers(request: pytest.FixtureRequest) -> None:
    """Before each test that uses the session's server, one 1-token request must be answered. A server
    that stopped answering (a hung stub) would otherwise cost every later test its whole timeout,
    and CI its time limit, with nothing said about why (a CI run was killed that way): the first
    such test fails within LIVE_TIMEOUT_S, showing the stacks of the server's Python stubs and the
    end of its log, and every later one fails at once."""
    if "server" not in request.fixturenames:
        return
    if _wedged:
        pytest.fail(f"the session's tritonserver stopped answering before {_wedged[0]} (its stacks are in that test's failure)",
                    pytrace=False)
    from specgate_client import GenerateParams, HttpClient

    client = HttpClient(f"localhost:{request.getfixturevalue('server').http}", timeout_s=LIVE_TIMEOUT_S)
    try:
        client.generate("Hi", GenerateParams(max_tokens=1), spec_mode="off")
    except Exception as exc:  # whatever it was, the server did not answer
        _wedged.append(request.node.nodeid)
        pytest.fail(f"the session's tritonserver did not answer a 1-token request ({exc!r})\n{_server_state()}", pytrace=False)
    finally:
        client.close()


def _server_state() -> str:
    """What the session's server is doing: each Python stub's thread stacks (py-spy, native frames
    included: a wait for the GIL or a lock shows) and the end of its log."""
    from tests.integration.server_state import MODELS

    spy = Path(sys.executable).with_name("py-spy")
    out = []
    for model in MODELS:
        for pid in sorted(stub_pids(model)):
            dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            out.append(f"--- {model} stub {pid}:\n{dump.stdout}{dump.stderr}")
    log = (TEST_OUT / "tritonserver.log").read_text(errors="replace").splitlines()
    return "\n".join([*out, "--- the end of tritonserver.log:", *log[-40:]])


@pytest.fixture(scope="session")
def http(server):
    from specgate_client import HttpClient

    client = HttpClient(f"localhost:{server.http}")
    yield client
    client.close()  # else the server's stop waits its whole exit timeout for these connections


@pytest.fixture(scope="session")
def grpc(server):
    from specgate_client import GrpcClient

    return GrpcClient(f"localhost:{server.grpc}")
