"""serving/engine_client: what the gate does with an engine request that it gives up on, how it sorts
an engine's refusals from its failures, and that every request carries the engine key (issue 26).
BLS runs on fake_pb_utils: each engine is a handler that answers the requests the gate sends."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

import numpy as np  # noqa: E402

from specgate.contract import PARAM_CANCEL, PARAM_CONTINUED, PARAM_ENGINE_KEY, PARAM_PING, PARAM_REQUEST_KEY  # noqa: E402
from specgate.errors import InvalidInput  # noqa: E402
from specgate.gate import Decision  # noqa: E402
from specgate.serving import bls  # noqa: E402
from specgate.serving.bls import EngineFailure, Silent  # noqa: E402
from specgate.serving.engine_client import EngineClient, EngineGone, EngineRefused, SharedPing  # noqa: E402
from specgate.serving.engine_key import EngineKey  # noqa: E402
from specgate.serving.llm_request import LLMRequest  # noqa: E402

SECRET = "s3cret"
LLM = LLMRequest(max_tokens=8, stream=True)
DECISION = Decision(route="speculative", reason="prod", shadow=False, algorithm="ngram", num_speculative_tokens=4, mode="prod",
                    tenant="org")


def _tokens(*ids: int) -> pb.InferenceResponse:
    return pb.InferenceResponse([pb.Tensor("output_ids", [list(ids)])])


class Engines:
    """Answers the gate's BLS requests: pings (or fails them), records stop messages, and serves a
    generation as `generation` says (an iterator, or a function that makes one per request)."""

    def __init__(self, generation: Iterator[Any] | Callable[[], Iterator[Any]] | None = None, ping_error: str | None = None) -> None:
        self.generation = generation if generation is not None else iter([_tokens(1, 2)])
        self.ping_error = ping_error
        self.ping: Callable[[], Iterator[Any]] | None = None  # answers pings instead of ping_error
        self.requests: list[pb.InferenceRequest] = []
        self.stopped: list[str] = []
        self.release = threading.Event()  # ends a silent generation (the test's cleanup)

    def __call__(self, req: pb.InferenceRequest) -> Iterator[Any]:
        self.requests.append(req)
        p = req.parameters
        if PARAM_PING in p and self.ping is not None:
            return self.ping()
        if PARAM_PING in p:
            return iter([pb.InferenceResponse([], pb.TritonError(self.ping_error)) if self.ping_error else pb.InferenceResponse([])])
        if PARAM_CANCEL in p:
            self.stopped.append(p[PARAM_CANCEL])
            return iter([pb.InferenceResponse([])])
        return self.generation() if callable(self.generation) else self.generation

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


def test_a_stalled_engine_is_told_to_stop(engines: Engines) -> None:
    """spec_engine says nothing for longer than the stall timeout: the gate gives up (EngineFailure).
    Before issue 26 only a client's cancellation sent the stop, so such a request kept the engine
    busy, unread."""
    engines.generation = engines.silent()
    with pytest.raises(EngineFailure, match="no response"):
        _run(_client(stall_s=0.1))  # under the fixture's PROBE_AFTER_S: no ping comes first
    assert engines.wait_stopped() == [engines.key_of_generation()]


def test_an_engine_that_fails_its_ping_is_not_sent_a_stop(engines: Engines) -> None:
    """A failed ping means the engine's process is dead or stuck: a stop could not reach it, and on a
    dead stub each message waits out Triton's health check in the queue ahead of other requests' pings."""
    engines.generation, engines.ping_error = engines.silent(), "Stub process 'spec_engine_0_0' is not healthy."
    with pytest.raises(EngineGone, match="not answering"):
        _run(_client())
    time.sleep(0.3)  # a stop would be on its way by now
    assert engines.stopped == []


def test_silent_requests_on_a_dead_engine_all_fail_at_once(engines: Engines) -> None:
    """Four silent baseline requests, a dead engine (each ping answered after 0.5 s, with an error):
    every one of them fails on the ping of the first (SharedPing), and none sends a stop."""
    def slow_dead_ping() -> Iterator[Any]:
        time.sleep(0.5)
        yield pb.InferenceResponse([], pb.TritonError("Stub process 'target_engine_0_0' is not healthy."))

    engines.generation = engines.silent  # a fresh silent generation per request
    engines.ping = slow_dead_ping
    client = _client()
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(_run, client, "target_engine") for _ in range(4)]
        errors = [f.exception(timeout=30) for f in futures]
    assert all(isinstance(e, EngineGone) and "target_engine is not answering" in str(e) for e in errors), errors
    time.sleep(0.3)
    assert engines.stopped == []


def test_callers_during_a_ping_share_it_and_a_later_caller_pings_again() -> None:
    calls, release = [], threading.Event()

    def ping() -> None:
        calls.append(1)
        release.wait()
        raise EngineFailure("spec_engine is not answering: boom")

    shared = SharedPing(ping)
    entered = [threading.Event() for _ in range(4)]

    def call(i: int) -> Exception | None:
        entered[i].set()
        try:
            shared()
        except Exception as exc:
            return exc
        return None

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(call, i) for i in range(4)]
        for e in entered:
            e.wait(10)
        time.sleep(1.0)  # each has long since joined the flight (a few bytecodes after `entered`)
        release.set()
        errors = [f.result(timeout=10) for f in futures]
    assert len(calls) == 1
    assert all(isinstance(e, EngineGone) and str(e) == "spec_engine is not answering: boom" for e in errors)
    assert len({id(e) for e in errors}) == 4  # one exception each: no traceback shared across threads
    with pytest.raises(EngineGone):
        shared()  # no verdict is kept: a later silence pings again
    assert len(calls) == 2


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
        ("target_engine", pb.TritonError.INTERNAL, "Stub process 'target_engine_0_0' is not healthy.", EngineFailure,
         "target_engine is not answering"),
    ],
)
def test_refusals_failures_and_dead_engines_are_told_apart(
    engines: Engines, engine: str, code: int, message: str, raised: type, needle: str
) -> None:
    """A refusal (INVALID_ARG) never counts against a breaker: the gate serves a refused speculative
    request on the baseline, and a refused baseline request is the client's error. A dead stub is
    worded as a failed ping is, which the front answers with 503."""
    engines.generation = iter([pb.InferenceResponse([], pb.TritonError(message, code))])
    with pytest.raises(raised, match=needle):
        _run(_client(), engine)
    time.sleep(0.3)
    assert engines.stopped == []  # it answered with its final (error) response: nothing to stop


def test_a_ping_that_heard_nothing_is_sent_once_more() -> None:
    """A ping handed to a stub as it is killed is never answered: the second ping's verdict counts
    (a dead stub fails it; a live one that answers it is alive)."""
    answers = iter([Silent("target_engine: no response for 10 s"),
                    EngineFailure("target_engine is not answering: Stub process is not healthy")])

    def ping() -> None:
        raise next(answers)

    with pytest.raises(EngineGone, match="is not answering: Stub process"):
        SharedPing(ping)()
    silent_once = iter([Silent("spec_engine: no response for 10 s"), None])

    def ping_then_answer() -> None:
        if (e := next(silent_once)) is not None:
            raise e

    SharedPing(ping_then_answer)()  # answered the second time: alive, no error


def test_a_continuation_tells_the_engine_how_much_of_its_input_is_output(engines: Engines) -> None:
    """Issue 49: the gate continues a request on the other engine from prompt + output; the engine
    must know which input tokens are output, so that a stop word spanning the two ends it."""
    stops = np.array([[7, 8], [2, -1]], np.int32)
    _client().run("target_engine", LLM, DECISION, [1, 2, 3, 7], stops, lambda t, s: None, threading.Event(), already=1)
    _client().run("target_engine", LLM, DECISION, [1, 2, 3], stops, lambda t, s: None, threading.Event())
    continued, fresh = (r.parameters for r in engines.requests)
    assert continued[PARAM_CONTINUED] == 1 and PARAM_CONTINUED not in fresh


def test_a_hung_engine_is_reported_as_not_answering(monkeypatch: pytest.MonkeyPatch, engines: Engines) -> None:
    """Issue 49: a live but hung stub answers no ping. Its requests failed with "target_engine: no
    response for 10 s", which the front read as a fault of ours (500, never retried elsewhere); it is
    an engine that is not answering, like a dead one (502, which HAProxy retries on another replica)."""
    from specgate.serving import engine_client
    from specgate_front.triton import classify

    monkeypatch.setattr(engine_client, "CONTROL_TIMEOUT_S", 0.3)
    engines.generation = engines.silent()
    engines.ping = engines.silent
    with pytest.raises(EngineGone) as gone:
        _run(_client(), "target_engine")
    assert str(gone.value).startswith("target_engine is not answering: ")
    assert classify(f"in ensemble 'llm', {gone.value}").status == 502
