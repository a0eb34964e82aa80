"""serving/engine_client: what the gate does with an engine request that it gives up on, how it sorts
an engine's refusals from its failures, and that every request carries the engine key (issue 26).
BLS runs on fake_pb_utils: each engine is a handler that answers the requests the gate sends."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.contract import PARAM_CANCEL, PARAM_ENGINE_KEY, PARAM_PING, PARAM_REQUEST_KEY  # noqa: E402
from specgate.errors import InvalidInput  # noqa: E402
from specgate.gate import Decision  # noqa: E402
from specgate.serving import bls  # noqa: E402
from specgate.serving.bls import EngineFailure  # noqa: E402
from specgate.serving.engine_client import EngineClient, EngineRefused  # noqa: E402
from specgate.serving.engine_key import EngineKey  # noqa: E402
from specgate.serving.llm_request import LLMRequest  # noqa: E402

SECRET = "s3cret"
LLM = LLMRequest(max_tokens=8, stream=True)
DECISION = Decision(route="speculative", reason="prod", shadow=False, algorithm="ngram", num_speculative_tokens=4, mode="prod", tenant="org")


def _tokens(*ids: int) -> pb.InferenceResponse:
    return pb.InferenceResponse([pb.Tensor("output_ids", [list(ids)])])


class Engines:
    """Answers the gate's BLS requests: pings (or fails them), records stop messages, and serves a
    generation as `generation` says."""

    def __init__(self, generation: Iterator[Any] | None = None, ping_error: str | None = None) -> None:
        self.generation = generation if generation is not None else iter([_tokens(1, 2)])
        self.ping_error = ping_error
        self.requests: list[pb.InferenceRequest] = []
        self.stopped: list[str] = []
        self.release = threading.Event()  # ends a silent generation (the test's cleanup)

    def __call__(self, req: pb.InferenceRequest) -> Iterator[Any]:
        self.requests.append(req)
        p = req.parameters
        if PARAM_PING in p:
            return iter([pb.InferenceResponse([], pb.TritonError(self.ping_error)) if self.ping_error else pb.InferenceResponse([])])
        if PARAM_CANCEL in p:
            self.stopped.append(p[PARAM_CANCEL])
            return iter([pb.InferenceResponse([])])
        return self.generation

    def silent(self) -> Iterator[Any]:
        self.release.wait()
        yield from ()

    def key_of_generation(self) -> str:
        return next(r.parameters[PARAM_REQUEST_KEY] for r in self.requests if PARAM_REQUEST_KEY in r.parameters)

    def wait_stopped(self, timeout_s: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not self.stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.stopped


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engines]:
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.2)
    e = Engines()
    pb.InferenceRequest.handler = e
    yield e
    e.release.set()
    pb.InferenceRequest.handler = None


def _client(stall_s: float = 60.0) -> EngineClient:
    return EngineClient(end_id=2, extensions=True, stall_timeout_s=lambda: stall_s, key=EngineKey(SECRET))


def _run(client: EngineClient, engine: str = "spec_engine", on_tokens: Any = lambda t, s: None) -> Any:
    return client.run(engine, LLM, DECISION, [1, 2, 3], None, on_tokens, threading.Event())


def test_every_request_carries_the_engine_key(engines: Engines) -> None:
    client = _client()
    _run(client)
    client.control("spec_engine", {PARAM_PING: True})
    assert len(engines.requests) == 2 and all(r.parameters[PARAM_ENGINE_KEY] == SECRET for r in engines.requests)


def test_a_finished_request_is_not_stopped(engines: Engines) -> None:
    _run(_client())
    time.sleep(0.3)  # a stop would be on its way by now
    assert engines.stopped == []


def test_an_engine_given_up_on_is_told_to_stop(engines: Engines) -> None:
    """The engine goes silent and then fails its ping: the gate gives up (EngineFailure). Before issue
    26 only a client's cancellation sent the stop, so this request kept the engine busy, unread."""
    engines.generation, engines.ping_error = engines.silent(), "stub gone"
    with pytest.raises(EngineFailure, match="not answering"):
        _run(_client())
    assert engines.wait_stopped() == [engines.key_of_generation()]


def test_a_gate_error_while_forwarding_stops_the_engine_request(engines: Engines) -> None:
    def tokens_then_silence() -> Iterator[Any]:
        yield _tokens(7)
        engines.release.wait()

    engines.generation = tokens_then_silence()

    def broken(tokens: list[int], stats: Any) -> None:
        raise RuntimeError("the client stream broke")

    with pytest.raises(RuntimeError, match="client stream"):
        _run(_client(), on_tokens=broken)
    assert engines.wait_stopped() == [engines.key_of_generation()]


@pytest.mark.parametrize(
    "engine, code, message, raised, needle",
    [
        ("spec_engine", pb.TritonError.INVALID_ARG, "input_ids must be token ids", EngineRefused, "spec_engine: input_ids"),
        ("target_engine", pb.TritonError.INVALID_ARG, "input_ids must be token ids", InvalidInput, "input_ids"),
        ("spec_engine", pb.TritonError.INTERNAL, "engine error: boom", EngineFailure, "spec_engine: engine error"),
        ("target_engine", pb.TritonError.INTERNAL, "Stub process 'target_engine_0_0' is not healthy.", EngineFailure, "target_engine is not answering"),
    ],
)
def test_refusals_failures_and_dead_engines_are_told_apart(engines: Engines, engine: str, code: int, message: str, raised: type, needle: str) -> None:
    """A refusal (INVALID_ARG) never counts against a breaker: the gate serves a refused speculative
    request on the baseline, and a refused baseline request is the client's error. A dead stub is
    worded as a failed ping is, which the front answers with 503."""
    engines.generation = iter([pb.InferenceResponse([], pb.TritonError(message, code))])
    with pytest.raises(raised, match=needle):
        _run(_client(), engine)
    time.sleep(0.3)
    assert engines.stopped == []  # it answered with its final (error) response: nothing to stop
