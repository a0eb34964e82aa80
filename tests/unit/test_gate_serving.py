"""The gate's and postprocessing's Triton adapters on fake_pb_utils (issue 26):

- a shadow mirror's slot is freed whatever ends the request it mirrors (before: only an engine
  failure or a cancellation freed it, and after max_concurrent_mirrors other errors every later
  shadow decision was `shadow_busy` until a restart);
- postprocessing never waits on spec_gate: a cancellation is relayed off its thread, so a gate that
  does not answer stalls no response (before: a BLS call without a timeout inside `execute`);
- postprocessing swallows the gate's heartbeats and writes the gate's outputs, from its state, with the text;
- an error after responses went out reaches postprocessing as data in the gate's final response,
  and postprocessing answers it as that error (Triton 2.51's ensemble never completes a request
  whose step errs while its other steps run: contract.GateState.error).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.contract import GATE_OUTPUTS, GATE_STATE_TENSOR, PARAM_CANCEL, PARAM_ENGINE_KEY, GateState  # noqa: E402
from specgate.errors import InvalidInput  # noqa: E402
from specgate.gate import Gate, RequestInputs  # noqa: E402
from specgate.serving.bls import EngineFailure  # noqa: E402
from specgate.serving.cancel_relay import CancelRelay  # noqa: E402
from specgate.serving.client_stream import ClientStream  # noqa: E402
from specgate.serving.engine_client import EngineClient  # noqa: E402
from specgate.serving.engine_key import EngineKey  # noqa: E402
from specgate.serving.gate_model import GateModel  # noqa: E402
from specgate.serving.live_requests import LiveRequests  # noqa: E402
from specgate.serving.llm_request import LLMRequest  # noqa: E402
from specgate.serving.shadow import Shadow  # noqa: E402
from specgate.serving.text_models import PostprocessingModel  # noqa: E402
from specgate.stats import SpecStats  # noqa: E402
from specgate.text.tokenizer import PromptTokenizer  # noqa: E402

SECRET = "s3cret"
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
POSTPROCESSING_OUTPUTS = ["text_output", *(t.name for t in GATE_OUTPUTS)]


@pytest.fixture
def handler() -> Iterator[dict[str, Any]]:
    """{model name: function(request) -> iterator of responses} answering BLS requests."""
    routes: dict[str, Any] = {}
    pb.InferenceRequest.handler = lambda req: routes[req.model_name](req)
    yield routes
    pb.InferenceRequest.handler = None


def _gate(tmp_path: Path, policy: str = "mode: off\n") -> GateModel:
    (tmp_path / "p.yaml").write_text(policy)
    gm = GateModel.__new__(GateModel)
    gm.gate = Gate(str(tmp_path / "p.yaml"))
    gm.engines = EngineClient(2, True, lambda: 60.0, EngineKey(SECRET))
    gm.shadow = Shadow(gm.gate, gm.engines)
    return gm


def test_a_mirror_slot_is_freed_whatever_ends_its_request(tmp_path: Path, handler: dict[str, Any]) -> None:
    handler["spec_engine"] = lambda req: iter([pb.InferenceResponse([pb.Tensor("output_ids", [[4, 5]])])])  # the mirror
    handler["target_engine"] = lambda req: iter([pb.InferenceResponse([], pb.TritonError("input_ids: bad", pb.TritonError.INVALID_ARG))])
    gm = _gate(tmp_path, "mode: shadow\nshadow:\n  max_concurrent_mirrors: 1\n")
    inputs = RequestInputs(temperature=0.0)
    d = gm.gate.decide(inputs)
    assert (d.reason, d.shadow) == ("shadow", True)  # it holds the one mirror slot
    llm = LLMRequest(max_tokens=4)
    with pytest.raises(InvalidInput):  # not an engine failure, not a cancellation
        gm._serve_baseline(ClientStream(pb.ResponseSender(), False, d.route, d.reason, 1), threading.Event(), llm, d, [1, 2], None)
    gm.gate.finish(d)

    def next_reason() -> str:
        nd = gm.gate.decide(inputs)
        gm.gate.finish(nd)
        if nd.shadow:
            gm.gate.end_shadow(nd, None)
        return nd.reason

    deadline = time.monotonic() + 30  # the mirror ends on the shadow pool
    while (reason := next_reason()) != "shadow" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reason == "shadow", "the mirror slot was never freed"
    gm.shadow.shutdown()
    gm.engines.shutdown()


def test_a_request_whose_target_engine_dies_finishes_on_spec_engine(tmp_path: Path, handler: dict[str, Any]) -> None:
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
    gm = _gate(tmp_path)
    d = gm.gate.decide(RequestInputs(temperature=0.0))
    out = ClientStream(pb.ResponseSender(), True, d.route, d.reason, 1)
    gm._serve_baseline(out, threading.Event(), LLMRequest(max_tokens=3, stream=True), d, [1, 2], None)
    gm.gate.finish(d)
    assert out.ids == [7, 8, 9] and (out.route, out.reason) == ("speculative", "target_engine_failure")
    (req,) = asked
    assert [t.as_numpy().reshape(-1).tolist() for t in req.inputs if t.name() == "input_ids"] == [[1, 2, 7, 8]]
    assert [t.as_numpy().reshape(-1).tolist() for t in req.inputs if t.name() == "request_output_len"] == [[1]]
    assert speculating == [0]  # the baseline cannot take it back: no hand-over may be asked for it

    # with spec_engine gone too, the client hears that target_engine is not answering
    handler["spec_engine"] = lambda req: iter([pb.InferenceResponse([], pb.TritonError("Stub process 'spec_engine_0_0' is not healthy."))])
    d = gm.gate.decide(RequestInputs(temperature=0.0))
    with pytest.raises(EngineFailure, match="target_engine is not answering"):
        gm._serve_baseline(ClientStream(pb.ResponseSender(), False, d.route, d.reason, 2), threading.Event(), LLMRequest(max_tokens=3), d, [1, 2], None)
    gm.gate.finish(d)
    gm.shadow.shutdown()
    gm.engines.shutdown()


def _gate_state(response: Any) -> GateState:
    return GateState.model_validate_json(pb.get_output_tensor_by_name(response, GATE_STATE_TENSOR).as_numpy()[0])


class PostRequest:
    """One gate response as postprocessing receives it."""

    def __init__(self, ids: list[int], prev: int, final: bool, key: int, cancelled: bool) -> None:
        state = GateState(prev_output_length=prev, is_final=final, request_key=key, route="speculative", gate_reason="prod",
                          num_draft_tokens=6, num_accepted_tokens=3, acceptance_rate=0.5, num_output_tokens=len(ids), draft_budget=4)  # fmt: skip
        self.inputs = [
            pb.Tensor("output_ids", np.array(ids, np.int32)),
            pb.Tensor(GATE_STATE_TENSOR, np.array([state.model_dump_json().encode()], np.object_)),
        ]
        self.sender, self._cancelled = pb.ResponseSender(), cancelled

    def get_response_sender(self) -> pb.ResponseSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return POSTPROCESSING_OUTPUTS  # what the `llm` ensemble asks of its step

    def is_cancelled(self) -> bool:
        return self._cancelled


def _execute_in_time(model: PostprocessingModel, request: PostRequest) -> None:
    done = threading.Thread(target=model.execute, args=([request],), daemon=True)
    done.start()
    done.join(timeout=30)
    assert not done.is_alive(), "postprocessing waited on spec_gate"


def test_postprocessing_relays_a_cancel_without_waiting_on_a_hung_gate(checkpoint: Path, handler: dict[str, Any]) -> None:
    hung, asked = threading.Event(), []

    def gate(req: pb.InferenceRequest) -> Iterator[Any]:
        asked.append(req.parameters)
        hung.wait()  # never answers while the test runs
        yield from ()

    handler["spec_gate"] = gate
    model = PostprocessingModel.__new__(PostprocessingModel)
    model.tok = PromptTokenizer(checkpoint, 1)
    model.relay = CancelRelay(EngineKey(SECRET))
    try:
        heartbeat = PostRequest([], 0, False, key=77, cancelled=True)
        _execute_in_time(model, heartbeat)
        assert heartbeat.sender.sent == [(None, FINAL)]  # a heartbeat reaches no client
        deadline = time.monotonic() + 30
        while not asked and time.monotonic() < deadline:
            time.sleep(0.05)
        assert asked == [{PARAM_CANCEL: "77", PARAM_ENGINE_KEY: SECRET}]
        # the gate still hangs: the next response of another request goes out all the same
        ids = PromptTokenizer(checkpoint, 64).encode("Hello there")
        final = PostRequest(ids, 0, True, key=78, cancelled=False)
        _execute_in_time(model, final)
        ((response, flags),) = final.sender.sent
        out = {t.name(): t.as_numpy() for t in response.output_tensors()}
        assert flags == FINAL and out["text_output"][0].decode() == "Hello there"
        assert set(out) == {"text_output", *(t.name for t in GATE_OUTPUTS)} and out["route"][0] == b"speculative"
        _execute_in_time(model, PostRequest([], 0, False, key=77, cancelled=True))  # the same key is not relayed twice
        time.sleep(0.3)
        assert len(asked) == 1
    finally:
        hung.set()


class GateResponseAsRequest:
    """A response the gate sent, as the postprocessing request the ensemble makes of it."""

    def __init__(self, response: Any) -> None:
        self.inputs, self.sender = response.output_tensors(), pb.ResponseSender()

    def get_response_sender(self) -> pb.ResponseSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return POSTPROCESSING_OUTPUTS

    def is_cancelled(self) -> bool:
        return True  # the client left; a final response is not relayed


@pytest.mark.parametrize("code", ["cancelled", "internal", "unavailable", "invalid_arg"])
def test_an_error_after_responses_went_out_is_data_that_postprocessing_answers(checkpoint: Path, code: str) -> None:
    before = pb.ResponseSender()
    ClientStream(before, True, "baseline", "mode_off", 5).fail(code, "nothing went out yet")
    ((response, flags),) = before.sent
    assert flags == FINAL and response.has_error()  # no step of it runs: an error response is safe

    during = pb.ResponseSender()
    out = ClientStream(during, True, "baseline", "mode_off", 6)
    out.send([9906, 1835], SpecStats())  # a chunk went to postprocessing
    out.fail(code, f"ended: {code}")
    (chunk, _), (final, flags) = during.sent
    assert flags == FINAL and not final.has_error(), "an error response from the gate here leaves the ensemble request in flight"
    assert _gate_state(final).error == (code, f"ended: {code}")
    assert _gate_state(chunk).error == ("", "")

    model = PostprocessingModel.__new__(PostprocessingModel)
    model.tok = PromptTokenizer(checkpoint, 1)
    model.relay = CancelRelay(EngineKey(SECRET))
    request = GateResponseAsRequest(final)
    _execute_in_time(model, request)
    ((answer, flags),) = request.sender.sent
    assert flags == FINAL and answer.has_error()
    assert (answer.error().code(), answer.error().message()) == (getattr(pb.TritonError, code.upper()), f"ended: {code}")


def test_a_client_that_leaves_while_queued_frees_its_place(tmp_path: Path) -> None:
    """Issue 49: a request queued for admission sent postprocessing nothing, so a client that left
    was never seen: it held its queue place until admitted or timed out, and live clients got 503."""
    from specgate.gate.admission import Overloaded

    gm = _gate(tmp_path, "mode: off\nadmission: {max_concurrent: 1, max_queued: 1, queue_timeout_s: 60}\n")
    gm.live, gm.pool = LiveRequests(), None
    holder = gm.gate.admission.enter()  # the one slot, taken
    d, ticket = gm.gate.decide(RequestInputs()), gm.gate.admission.enter()  # queued behind it
    sender = pb.ResponseSender()
    serving = threading.Thread(target=gm._serve, args=(sender, LLMRequest(max_tokens=4), d, [1, 2], None, ticket), daemon=True)
    serving.start()
    deadline = time.monotonic() + 10
    while not sender.sent and time.monotonic() < deadline:  # what postprocessing would look at
        time.sleep(0.05)
    assert sender.sent, "a queued request sent no heartbeat: postprocessing cannot see its client leave"
    gm._cancel(_gate_state(sender.sent[0][0]).request_key)  # postprocessing found it cancelled
    serving.join(timeout=10)
    assert not serving.is_alive(), "the departed client still waits for a slot"
    response, flags = sender.sent[-1]
    assert flags == FINAL and "cancelled" in _gate_state(response).error[1]
    assert gm.gate.admission.queued == 0
    gm.gate.admission.enter()  # its place is free for a live client
    with pytest.raises(Overloaded):
        gm.gate.admission.enter()
    gm.gate.admission.leave(holder)
    gm.shadow.shutdown()
    gm.engines.shutdown()


def test_a_cancellation_whose_message_failed_is_sent_again(handler: dict[str, Any]) -> None:
    """Issue 49: the relay marked a key as relayed before sending it, so a message that failed (the
    gate busy past the timeout, a BLS error) was never sent again, and the request ran to its end."""
    asked: list[dict] = []

    def gate(req: pb.InferenceRequest) -> Iterator[Any]:
        asked.append(req.parameters)
        if len(asked) == 1:
            raise pb.TritonModelException("spec_gate is busy")
        yield pb.InferenceResponse([])

    handler["spec_gate"] = gate
    relay = CancelRelay(EngineKey(SECRET))

    def relayed(n: int) -> bool:
        deadline = time.monotonic() + 10
        while len(asked) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # and its outcome handled
        return len(asked) >= n

    relay.cancel(77)
    assert relayed(1)
    relay.cancel(77)  # the request's next response, still cancelled
    assert relayed(2), "a cancellation whose message failed was not sent again"
    relay.cancel(77)  # delivered now: not sent a third time
    time.sleep(0.5)
    assert [p[PARAM_CANCEL] for p in asked] == ["77", "77"]
