"""Can a ready tritonserver still serve? What a replica's supervisor checks beyond its process.

A tritonserver outlives its Python-backend stubs. When an engine's stub dies (an OOM kill, a crash in
an engine), Triton 2.51 keeps the model READY, fails its requests, and never starts a new stub: with
target_engine gone every request fails, with spec_engine gone every request falls back to the
baseline. A reload through the repository API brings the stub back, but 2.51 can wedge in it, the
model LOADING for ever (docs/robustness.md, "Limits"). In both cases `/v2/health/ready` still
answers 200, so neither a load balancer nor a kubelet sees anything wrong. The supervisor does
(`Replica.poll`): it reloads spec_engine, which the server can do without meanwhile, and restarts
the server for anything else.

A stub that is alive but hung (stopped, deadlocked) keeps the model READY and its process count
whole, and fails every request that reaches it (a gate request after two unanswered pings), or, when
it is spec_gate's, hangs every request. The supervisor pings each CPU engine as the gate does, and the
gate itself (contract.PARAM_PING, with the engine key): one that answers no ping is hung, and its
stubs are killed, which makes it a dead stub like any other.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from google.protobuf import text_format
from pydantic import BaseModel
from tritonclient.grpc import model_config_pb2

STUB = "triton_python_backend_stub"
# A model LOADING longer than this is taken for wedged. Loading an engine takes seconds on CPU; a large
# TensorRT-LLM engine can take minutes.
LOAD_TIMEOUT_S = 300.0


# Models the server serves without: the gate puts every request on the baseline while spec_engine is
# away (docs/robustness.md), so a dead spec_engine stub is reloaded, not the whole server restarted.
RELOADABLE = frozenset({"spec_engine"})
# The models that answer a ping (as Python-backend stubs). spec_gate's Python can stop while its
# process and Triton's health flag live on (a lock-order cycle inside Triton 2.51's Python backend,
# docs/robustness.md "Limits"); then every request hangs, and only its ping tells.
PINGED = ("spec_gate", "target_engine", "spec_engine")
PING_TIMEOUT_S = 10.0  # a live stub answers at once, also while it decodes (the gate waits as long)


class Fault(BaseModel):
    model: str
    reason: str  # what the supervisor prints
    wedged: bool = False  # LOADING too long: only a restart ends it
    hung: bool = False  # its stubs live but answer no ping: killed, they are dead stubs


class ModelState(BaseModel):
    """One row of Triton's repository index (`POST /v2/repository/index`)."""

    name: str
    state: str = ""  # READY, LOADING, UNLOADING, UNAVAILABLE; absent for a model never loaded
    version: str = ""
    reason: str = ""


def _repository(http_port: int, headers: dict[str, str], path: str, timeout_s: float) -> bytes:
    """POST to Triton's model-repository API (it sits behind the admin key: `headers`).

    urllib, as the supervisor's readiness check (`replica.is_ready`), rather than tritonclient's HTTP
    client: that one runs on gevent, and a client is not to be shared with the reload thread."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/{path}", data=b"{}", headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.read()


def repository_index(http_port: int, headers: dict[str, str], timeout_s: float = 5.0) -> list[ModelState] | None:
    """The server's model states; None when it does not answer (a busy or stopping server is not
    judged here: its liveness is the process check's and the probes')."""
    try:
        return [ModelState(**row) for row in json.loads(_repository(http_port, headers, "index", timeout_s))]
    except (OSError, ValueError):
        return None


def reload_model(http_port: int, headers: dict[str, str], model: str) -> None:
    """Unload, then load: on 2.51 a `load` alone of a model whose files did not change may do
    nothing, also when its stub is dead. Raises OSError (urllib's HTTPError names Triton's reason)."""
    for action in ("unload", "load"):
        _repository(http_port, headers, f"models/{model}/{action}", LOAD_TIMEOUT_S)


def python_instances(repo: Path) -> dict[str, int]:
    """Model -> how many stubs it runs when loaded: one per instance of a Python-backend model (our
    configs are all KIND_CPU). Other backends (the ensemble, tensorrtllm) run no stub."""
    out: dict[str, int] = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        try:
            config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        except text_format.ParseError:  # Triton refuses to load it, and says why in its log
            continue
        if config.backend == "python":
            out[path.parent.name] = sum(g.count or 1 for g in config.instance_group) or 1
    return out


def _stubs(server_pid: int) -> Iterator[tuple[str, int]]:
    """(model, pid) of each live stub process of this server: its descendants (the TensorRT-LLM pod
    starts tritonserver under mpirun), so other servers' stubs on the machine do not count. A stub's
    first argument is `<repository>/<model>/<version>/model.py`."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            argv = child.cmdline()
            if child.status() != psutil.STATUS_ZOMBIE and argv and argv[0].endswith(STUB) and len(argv) > 1:
                yield Path(argv[1]).parent.parent.name, child.pid
        except psutil.Error:  # it ended while we looked
            continue


def live_stubs(server_pid: int) -> Counter[str]:
    """Model -> live stub processes of this server."""
    return Counter(model for model, _ in _stubs(server_pid))


def kill_stubs(server_pid: int, model: str) -> None:
    """SIGKILL `model`'s stubs of this server (a hung one ignores anything gentler)."""
    for name, pid in list(_stubs(server_pid)):
        if name == model:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def ping_request(model: str) -> tuple[dict[str, Any], list[str]]:
    """The inputs and requested outputs of a ping to `model` (one of PINGED). spec_gate's inputs are
    all optional and a ping reads none: one id, and one of its outputs."""
    import numpy as np

    from specgate.contract import engine_inputs

    if model == "spec_gate":
        return {"input_ids": np.array([0], np.int32)}, ["text_output"]
    return engine_inputs([0], 1, 0, streaming=False), ["output_ids"]


def unanswered_pings(grpc_port: int, models: list[str], engine_key: str, timeout_s: float = PING_TIMEOUT_S) -> list[str]:
    """The models among `models` (of PINGED) that answered no ping within `timeout_s`, pinged at once."""
    from specgate.contract import PARAM_PING
    from specgate_client import ServerError, ServerUnreachable, stream_engine

    def answers(model: str) -> bool:
        arrays, outputs = ping_request(model)
        try:
            for _ in stream_engine(f"127.0.0.1:{grpc_port}", model, arrays, {PARAM_PING: True}, outputs, timeout_s, engine_key=engine_key):
                pass
            return True
        except ServerUnreachable:  # the server itself: its process check's and the probes' to judge
            return True
        except ServerError:  # an error (a dead stub), or no answer in time (a hung one)
            return False

    with ThreadPoolExecutor(max(1, len(models))) as pool:
        return [model for model, ok in zip(models, pool.map(answers, models)) if not ok]


class HealthCheck:
    """Judges one server's models, look after look; remembers since when a model has been LOADING.

    A model an operator unloaded (UNAVAILABLE) is the operator's choice, not a fault."""

    def __init__(self, expected_stubs: dict[str, int], load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.expected_stubs = expected_stubs
        self.load_timeout_s = load_timeout_s
        self._loading_since: dict[str, float] = {}

    def verdict(self, index: list[ModelState], stubs: Counter[str], now: float) -> Fault | None:
        """What keeps this server from serving as loaded, or None. Take `index` before `stubs`: a
        model reloaded between the two looks then shows its new stubs."""
        loading = {m.name for m in index if m.state == "LOADING"}
        self._loading_since = {name: self._loading_since.get(name, now) for name in loading}
        for name, since in sorted(self._loading_since.items()):
            if now - since > self.load_timeout_s:
                return Fault(model=name, reason=f"{name} has been LOADING for {now - since:.0f} s", wedged=True)
        for m in index:
            want = self.expected_stubs.get(m.name, 0)
            if m.state == "READY" and stubs[m.name] < want:
                return Fault(model=m.name, reason=f"{m.name} is READY but {want - stubs[m.name]} of its {want} stub processes died")
        return None
