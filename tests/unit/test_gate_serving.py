"""spec_gate's Triton adapter on fake_pb_utils, with this file's `Ensemble` playing Triton's part for
one `llm` request (issue 50: the gate detokenizes and answers the client itself; postprocessing is gone):

- the intake answers with the request's key, which schedules the serving step; the client's responses
  hold the gate's text and all its outputs, a character split across engine responses whole;
- the serving thread never waits on a client's round trip: what the engine streams while a send is
  under way goes out in one response (the Outbox);
- the intake's ticks are how a cancellation is seen: a cancelled tick stops the request and its engine
  request, and a client that leaves while queued for admission gives up its place;
- an error that ends a request goes out only once no other step of it is in flight (Triton 2.51's
  ensemble never completes a request whose step errs while another of its steps runs), and a refusal
  at admission closes the intake before it answers;
- a shadow mirror's slot is freed whatever ends the request it mirrors, and a request whose
  target_engine dies finishes on spec_engine (issues 26 and 49).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.contract import GATE_TICK, LLM_OUTPUTS, PARAM_CANCEL  # noqa: E402
from specgate.errors import InvalidInput  # noqa: E402
from specgate.gate import RequestInputs  # noqa: E402
from specgate.gate.metrics import InMemoryMetricFactory  # noqa: E402
from specgate.serving import gate_model  # noqa: E402
from specgate.serving.bls import EngineFailure  # noqa: E402
from specgate.serving.client_stream import ClientStream  # noqa: E402
from specgate.serving.engine_key import ENGINE_KEY_ENV  # noqa: E402
from specgate.serving.gate_model import GateModel  # noqa: E402
from specgate.serving.llm_request import LLMRequest  # noqa: E402
from specgate.serving.outbox import Outbox  # noqa: E402
from specgate.serving.request_context import RequestContext  # noqa: E402
from specgate.stats import SpecStats  # noqa: E402
from specgate.text.tokenizer import PromptTokenizer  # noqa: E402

SECRET = "s3cret"
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CLIENT_OUTPUTS = [t.name for t in LLM_OUTPUTS]  # what the ensemble asks of the serving step


class Sender(pb.ResponseSender):
    """A response sender that records, tells `on_send` of every send, and may be slow."""

    def __init__(self, on_send: Callable[[Any, int], None] | None = None, delay_s: float = 0.0) -> None:
        super().__init__()
        self.on_send, self.delay_s = on_send, delay_s
        self.cancelled = False
        self.done = threading.Event()

    def send(self, response: Any = None, flags: int = 0) -> None:
        time.sleep(self.delay_s)
        super().send(response, flags)
        if self.on_send is not None:
            self.on_send(response, flags)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def texts(self) -> list[str]:
        return [r.as_numpy("text_output")[0].decode() for r, _ in self.sent if r is not None and not r.has_error()]


def _as_numpy(self: pb.InferenceResponse, name: str) -> np.ndarray:
    return pb.get_output_tensor_by_name(self, name).as_numpy()


pb.InferenceResponse.as_numpy = _as_numpy  # type: ignore[attr-defined]


class Request:
    """A request as a Python-backend model receives it."""

    def __init__(self, inputs: dict[str, Any], wanted: list[str], sender: Sender, params: dict | None = None) -> None:
        self.inputs = [pb.Tensor(name, np.asarray(v)) for name, v in inputs.items()]
        self.sender, self.wanted, self.params = sender, wanted, params or {}

    def get_response_sender(self) -> Sender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return self.wanted

    def parameters(self) -> str:
        return json.dumps(self.params)

    def request_id(self) -> str:
        return ""

    def is_cancelled(self) -> bool:
        return self.sender.cancelled


class Ensemble:
    """Triton's part in one `llm` request: the intake step, then each intake response schedules a
    step of the gate (n = 0: the serving step, whose sender is the client's; n > 0: a tick), marked
    cancelled once the client cancelled. Records which steps are in flight whenever the client's
    sender sends an error."""

    def __init__(self, gm: GateModel, ids: list[int], params: dict | None = None, tick_delay_s: float = 0.0, **knobs: Any) -> None:
        """`tick_delay_s`: how long a tick waits in the gate's queue (a busy gate)."""
        self.gm, self.tick_delay_s = gm, tick_delay_s
        self.cancelled = False
        self.lock = threading.Lock()
        self.in_flight: set[Sender] = set()
        self.in_flight_at_error: set[Sender] | None = None
        self.ticks: list[Sender] = []
        self.client = self._step_sender()
        self.intake = self._step_sender(self._scheduled)
        inputs = {"input_ids": np.array(ids, np.int32), "input_lengths": np.array([len(ids)], np.int32)}
        inputs.update({k: np.array([v]) for k, v in knobs.items()})
        gm.execute([Request(inputs, [GATE_TICK.name], self.intake, params)])

    def cancel(self) -> None:
        """The client leaves: Triton marks every step scheduled from now on."""
        self.cancelled = True

    def wait(self, timeout_s: float = 30) -> None:
        assert self.client.done.wait(timeout_s), "the client got no final response"

    def _step_sender(self, on_send: Callable[[Any, int], None] | None = None) -> Sender:
        sender = Sender()

        def sent(response: Any, flags: int) -> None:
            with self.lock:
                if sender is self.client and response is not None and response.has_error():
                    self.in_flight_at_error = self.in_flight - {sender}
                if flags & FINAL:
                    self.in_flight.discard(sender)
            if on_send is not None:
                on_send(response, flags)

        sender.on_send = sent
        with self.lock:
            self.in_flight.add(sender)
        return sender

    def _scheduled(self, response: Any, flags: int) -> None:
        if response is None or response.has_error():  # the intake's final flag, or its refusal: nothing follows
            return
        key, n = (int(v) for v in response.as_numpy(GATE_TICK.name))
        sender = self.client if n == 0 else self._step_sender()
        if n:
            self.ticks.append(sender)
        sender.cancelled = self.cancelled
        step = Request({GATE_TICK.name: np.array([key, n], np.int64)}, CLIENT_OUTPUTS, sender)
        threading.Timer(self.tick_delay_s if n else 0.0, self.gm.execute, args=([step],)).start()  # the gate's queue


@pytest.fixture
def handler() -> Iterator[dict[str, Any]]:
    """{model name: function(request) -> iterator of responses} answering BLS requests."""
    routes: dict[str, Any] = {}
    pb.InferenceRequest.handler = lambda req: routes[req.model_name](req)
    yield routes
    pb.InferenceRequest.handler = None


@pytest.fixture
def make_gate(tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., GateModel]]:
    """A GateModel initialized as Triton does, from its config's parameters."""
    key = tmp_path / "engine.key"
    key.write_text(SECRET)
    key.chmod(0o600)
    monkeypatch.setenv(ENGINE_KEY_ENV, str(key))
    monkeypatch.setattr(gate_model, "watch_parent", lambda: None)
    made: list[GateModel] = []
    metrics = InMemoryMetricFactory()
    monkeypatch.setattr(gate_model, "pb_utils", metrics)  # what the gate exports, for the tests to read

    def make(policy: str = "mode: off\n") -> GateModel:
        (tmp_path / "policy.yaml").write_text(policy)
        params = {
            "policy_path": str(tmp_path / "policy.yaml"), "calibration_path": "", "tokenizer_dir": str(checkpoint), "max_output_len": "64",
            "max_input_len": "512", "vocab_size": "49152", "end_id": "2", "engine_extensions": "true",
        }  # fmt: skip
        gm = GateModel()
        metrics.families.clear()
        gm.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})})
        gm.metrics = metrics  # type: ignore[attr-defined]
        made.append(gm)
        return gm

    yield make
    for gm in made:
        gm.finalize()


@pytest.fixture
def tok(checkpoint: Path) -> PromptTokenizer:
    return PromptTokenizer(checkpoint, 512, chat=False)


def _engine(chunks: list[list[int]], pause_s: float = 0.0, stopped: threading.Event | None = None) -> Callable[[Any], Iterator[Any]]:
    """An engine that streams `chunks` (then its final statistics), `pause_s` apart, until `stopped`."""

    def run(req: pb.InferenceRequest) -> Iterator[Any]:
        if PARAM_CANCEL in req.parameters:  # the gate's stop message
            if stopped is not None:
                stopped.set()
            yield pb.InferenceResponse([])
            return
        for chunk in chunks:
            if stopped is not None and stopped.is_set():
                return
            time.sleep(pause_s)
            yield pb.InferenceResponse([pb.Tensor("output_ids", [chunk])])

    return run


def test_the_gate_answers_the_client_with_text_and_every_output(
    make_gate: Callable[..., GateModel], handler: dict, tok: PromptTokenizer
) -> None:
    text = "Crème brûlée 🍮 is a dessert."
    ids = tok.encode(text)
    split = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))  # a cut inside a character
    handler["target_engine"] = _engine([ids[:split], ids[split:]], pause_s=0.05)
    gm = make_gate()
    e = Ensemble(gm, [1, 2, 3], max_tokens=np.int32(64), stream=True)
    e.wait()
    responses = [r for r, _ in e.client.sent]
    assert "".join(e.client.texts()) == text
    assert all("\ufffd" not in t for t in e.client.texts()), "half a character went out"
    for r in responses:
        assert {t.name() for t in r.output_tensors()} == set(CLIENT_OUTPUTS)
    last = responses[-1]
    assert last.as_numpy("route")[0] == b"baseline" and last.as_numpy("gate_reason")[0] == b"mode_off"
    assert int(last.as_numpy("num_output_tokens")[0]) == len(ids) and e.client.sent[-1][1] == FINAL
    assert e.intake.done.is_set(), "the intake step never ended: the ensemble would never complete"


def test_a_non_streamed_request_gets_exactly_one_response(make_gate: Callable[..., GateModel], handler: dict, tok: PromptTokenizer) -> None:
    """HTTP generate on an ensemble needs exactly one response of its decoupled step."""
    ids = tok.encode("One answer, all at once.")
    handler["target_engine"] = _engine([ids])
    e = Ensemble(make_gate(), [1, 2, 3], max_tokens=np.int32(64))
    e.wait()
    assert [flags for _, flags in e.client.sent] == [FINAL] and e.client.texts() == ["One answer, all at once."]


def test_the_gate_decides_on_the_prompts_length(make_gate: Callable[..., GateModel], handler: dict, tok: PromptTokenizer) -> None:
    """The router keys a tenant's gain by prompt-length class: the adapter hands it the prompt's length."""
    handler["target_engine"] = _engine([tok.encode("ok")])
    gm = make_gate()
    seen: list[int] = []
    decide = gm.gate.decide
    gm.gate.decide = lambda inputs: seen.append(inputs.prompt_tokens) or decide(inputs)  # type: ignore[method-assign]
    Ensemble(gm, list(range(1, 301)), max_tokens=np.int32(8)).wait()
    assert seen == [300]


def test_the_outbox_coalesces_what_waits_behind_a_slow_client(tok: PromptTokenizer) -> None:
    """The serving thread records the engine's tokens and goes back to the engine: while one send
    waits on the client's round trip, later tokens go out together in the next response."""
    slow = Sender(delay_s=0.2)
    outbox = Outbox("gate-outbox")
    out = ClientStream(slow, True, gate_model.Route.BASELINE, "mode_off", tok, outbox)
    ids = tok.encode(" one two three four five six seven eight")
    start = time.monotonic()
    for t in ids:
        out.send([t], SpecStats())
    recorded = time.monotonic() - start
    out.finish()
    outbox.shutdown()
    assert recorded < 0.1, f"recording {len(ids)} tokens took {recorded:.2f} s: the serving thread waited on sends"
    assert "".join(slow.texts()) == tok.decode(ids)
    assert len(slow.sent) <= 3, f"{len(slow.sent)} responses for {len(ids)} tokens: nothing was coalesced"


def test_a_cancelled_tick_stops_the_request_and_its_engine(make_gate: Callable[..., GateModel], handler: dict) -> None:
    stopped = threading.Event()
    handler["target_engine"] = _engine([[100 + i] for i in range(200)], pause_s=0.02, stopped=stopped)
    gm = make_gate()
    e = Ensemble(gm, [1, 2, 3], max_tokens=np.int32(64), stream=True)
    while len(e.client.sent) < 3:
        time.sleep(0.01)
    e.cancel()
    e.wait()
    response, flags = e.client.sent[-1]
    assert flags == FINAL and response.has_error() and "cancelled" in response.error().message()
    assert any(t.cancelled for t in e.ticks), "no tick saw the cancellation"
    assert e.in_flight_at_error == set(), "the error went out while other steps of the request ran"
    assert stopped.wait(10), "the engine request was never stopped"
    assert gm.metrics.families["spec_gate_cancelled_total"].value() == 1


def test_an_engine_failure_after_responses_went_out_waits_for_every_step(make_gate: Callable[..., GateModel], handler: dict) -> None:
    """Both engines fail mid-stream: the client hears of it once the intake has ended and every tick
    has been answered (an error beside a step in flight leaves Triton 2.51's ensemble request open)."""
    dead = pb.TritonError("Stub process 'target_engine_0_0' is not healthy.", pb.TritonError.INTERNAL)

    def target(req: pb.InferenceRequest) -> Iterator[Any]:
        for i in range(8):
            time.sleep(0.05)  # several ticks go out meanwhile
            yield pb.InferenceResponse([pb.Tensor("output_ids", [[100 + i]])])
        yield pb.InferenceResponse([], dead)

    handler["target_engine"] = target
    handler["spec_engine"] = lambda req: iter([pb.InferenceResponse([], pb.TritonError("Stub process 'spec_engine_0_0' is not healthy."))])
    e = Ensemble(make_gate(), [1, 2, 3], max_tokens=np.int32(64), stream=True, tick_delay_s=0.2)
    e.wait()
    response, flags = e.client.sent[-1]
    assert flags == FINAL and response.has_error() and "target_engine is not answering" in response.error().message()
    assert e.ticks, "the request ended before any tick: this test checks nothing"
    assert e.in_flight_at_error == set()


def test_a_refusal_at_admission_ends_the_intake_first(make_gate: Callable[..., GateModel], handler: dict) -> None:
    gm = make_gate("mode: off\nadmission: {max_concurrent: 1, max_queued: 0}\n")
    holder = gm.gate.admission.enter()  # the one slot, taken
    e = Ensemble(gm, [1, 2, 3], max_tokens=np.int32(4))
    e.wait()
    response, flags = e.client.sent[-1]
    assert response.has_error() and "overloaded" in response.error().message()
    assert e.in_flight_at_error == set()
    gm.gate.admission.leave(holder)


def test_a_client_that_leaves_while_queued_frees_its_place(make_gate: Callable[..., GateModel], handler: dict) -> None:
    """Issue 49: a departed client held its queue place until admitted or timed out, and live clients
    were refused meanwhile. Its intake's ticks see it leave."""
    from specgate.gate.admission import Overloaded

    gm = make_gate("mode: off\nadmission: {max_concurrent: 1, max_queued: 1, queue_timeout_s: 60}\n")
    holder = gm.gate.admission.enter()
    e = Ensemble(gm, [1, 2, 3], max_tokens=np.int32(4))
    deadline = time.monotonic() + 10
    while not gm.gate.admission.queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gm.gate.admission.queued == 1
    e.cancel()
    e.wait()
    response, _ = e.client.sent[-1]
    assert response.has_error() and "cancelled" in response.error().message()
    assert gm.gate.admission.queued == 0
    gm.gate.admission.enter()  # its place is free for a live client
    with pytest.raises(Overloaded):
        gm.gate.admission.enter()
    gm.gate.admission.leave(holder)


def test_a_bad_request_is_refused_by_the_intake(make_gate: Callable[..., GateModel]) -> None:
    e = Ensemble(make_gate(), [1, 2, 3], max_tokens=np.int32(10**6))
    ((response, flags),) = e.intake.sent
    assert flags == FINAL and response.has_error() and "max_tokens" in response.error().message()
    assert not e.client.sent  # no serving step was ever scheduled


def test_a_direct_caller_is_served_on_its_own_request(make_gate: Callable[..., GateModel], handler: dict, tok: PromptTokenizer) -> None:
    ids = tok.encode("Hello there")
    handler["target_engine"] = _engine([ids])
    sender = Sender()
    inputs = {"input_ids": np.array([1, 2, 3], np.int32), "input_lengths": np.array([3], np.int32), "max_tokens": np.array([8], np.int32)}
    make_gate().execute([Request(inputs, ["text_output"], sender)])
    assert sender.done.wait(30)
    ((response, flags),) = sender.sent
    assert flags == FINAL and [t.name() for t in response.output_tensors()] == ["text_output"]
    assert response.as_numpy("text_output")[0].decode() == "Hello there"


def _context(gm: GateModel, llm: LLMRequest, prompt: list[int], sender: Sender, inputs: RequestInputs | None = None) -> RequestContext:
    ctx = RequestContext(llm, prompt, None, 1)
    d = gm.gate.decide(inputs or RequestInputs(temperature=0.0))
    ctx.admit(d, gm.gate.admission.enter(), ClientStream(sender, llm.stream, d.route, d.reason, gm.decoder, gm.outbox))
    return ctx


def test_a_mirror_slot_is_freed_whatever_ends_its_request(make_gate: Callable[..., GateModel], handler: dict) -> None:
    handler["spec_engine"] = lambda req: iter([pb.InferenceResponse([pb.Tensor("output_ids", [[4, 5]])])])  # the mirror
    handler["target_engine"] = lambda req: iter([pb.InferenceResponse([], pb.TritonError("input_ids: bad", pb.TritonError.INVALID_ARG))])
    gm = make_gate("mode: shadow\nshadow:\n  max_concurrent_mirrors: 1\n")
    ctx = _context(gm, LLMRequest(max_tokens=4), [1, 2], Sender())
    assert (ctx.decision.reason, ctx.decision.shadow) == ("shadow", True)  # it holds the one mirror slot
    with pytest.raises(InvalidInput):  # not an engine failure, not a cancellation
        gm._serve_baseline(ctx)
    gm.gate.finish(ctx.decision)

    def next_reason() -> str:
        nd = gm.gate.decide(RequestInputs(temperature=0.0))
        gm.gate.finish(nd)
        if nd.shadow:
            gm.gate.end_shadow(nd, None)
        return nd.reason

    deadline = time.monotonic() + 30  # the mirror ends on the shadow pool
    while (reason := next_reason()) != "shadow" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reason == "shadow", "the mirror slot was never freed"


def test_a_request_whose_target_engine_dies_finishes_on_spec_engine(make_gate: Callable[..., GateModel], handler: dict) -> None:
    """Issue 49: a dead target_engine stub failed its requests (HTTP generate answered them 400, which
    HAProxy does not retry). The gate now continues each on spec_engine from the prompt plus what
    was sent, as it continues a failed speculative request on the baseline."""
    dead = pb.TritonError("Stub process 'target_engine_0_0' is not healthy.", pb.TritonError.INTERNAL)
    asked: list[pb.InferenceRequest] = []
    speculating: list[int] = []  # what the load rule's hand-over sees while it runs there

    def target(req: pb.InferenceRequest) -> Iterator[Any]:
        yield pb.InferenceResponse([pb.Tensor("output_ids", [[7, 8]])])  # streamed, then the stub dies
        yield pb.InferenceResponse([], dead)

    def spec(req: pb.InferenceRequest) -> Iterator[Any]:
        asked.append(req)
        speculating.append(gm.engines.speculating)
        yield pb.InferenceResponse([pb.Tensor("output_ids", [[9]])])

    handler["target_engine"], handler["spec_engine"] = target, spec
    gm = make_gate()
    ctx = _context(gm, LLMRequest(max_tokens=3, stream=True), [1, 2], Sender())
    gm._serve_baseline(ctx)
    gm.gate.finish(ctx.decision)
    assert ctx.out.ids == [7, 8, 9] and (ctx.out.route, ctx.out.reason) == ("speculative", "target_engine_failure")
    (req,) = asked
    assert [t.as_numpy().reshape(-1).tolist() for t in req.inputs if t.name() == "input_ids"] == [[1, 2, 7, 8]]
    assert [t.as_numpy().reshape(-1).tolist() for t in req.inputs if t.name() == "request_output_len"] == [[1]]
    assert speculating == [0]  # the baseline cannot take it back: no hand-over may be asked for it

    # with spec_engine gone too, the client hears that target_engine is not answering
    handler["spec_engine"] = lambda req: iter([pb.InferenceResponse([], pb.TritonError("Stub process 'spec_engine_0_0' is not healthy."))])
    ctx = _context(gm, LLMRequest(max_tokens=3), [1, 2], Sender())
    with pytest.raises(EngineFailure, match="target_engine is not answering"):
        gm._serve_baseline(ctx)
    gm.gate.finish(ctx.decision)
