"""Our decoupled models send only the outputs their caller asked for (serving/triton_io.py,
RequestedOutputsSender): Triton 2.51 drops any other output off the GIL, which corrupted the stub's
heap. The integration test that a server survives such callers is in tests/integration/test_gate_soak.py
(the soak: `_partial_call`)."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.contract import ENGINE_EXTENSIONS, ENGINE_OUTPUTS, PARAM_ENGINE_KEY, PARAM_PING  # noqa: E402
from specgate.serving.engine_key import EngineKey  # noqa: E402
from specgate.serving.engine_model import EngineModel  # noqa: E402
from specgate.serving.live_requests import LiveRequests  # noqa: E402
from specgate.serving.outbox import Outbox  # noqa: E402
from specgate.serving.triton_io import RequestedOutputsSender  # noqa: E402

SECRET = "s3cret"


class Request:
    def __init__(self, wanted: list[str], params: dict | None = None) -> None:
        self.sender, self.wanted, self.params = pb.ResponseSender(), wanted, params or {}

    def get_response_sender(self) -> pb.ResponseSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return self.wanted

    def parameters(self) -> str:
        return json.dumps(self.params)


def names(response: Any) -> set[str]:
    return {t.name() for t in response.output_tensors()}


def test_unrequested_outputs_are_dropped_before_triton_sees_them() -> None:
    request = Request(["b"])
    sender = RequestedOutputsSender(request)
    sender.send(pb.InferenceResponse([pb.Tensor("a", [1]), pb.Tensor("b", [2]), pb.Tensor("c", [3])]), flags=0)
    error = pb.InferenceResponse([], pb.TritonError("bad"))
    sender.send(error, flags=1)
    sender.send(flags=1)
    (first, _), (second, _), (third, _) = request.sender.sent
    assert names(first) == {"b"} and first.output_tensors()[0].as_numpy().tolist() == [2]
    assert second is error and third is None  # errors and empty finals pass as they are


def test_an_engine_answers_a_control_message_with_only_what_it_asked_for() -> None:
    """The gate's control messages (ping, cancel, hand-over) ask for output_ids alone; an engine
    used to answer with all of its outputs, which Triton pruned off the GIL."""
    model = EngineModel.__new__(EngineModel)
    model.name, model.key, model.live, model.outbox = "target_engine", EngineKey(SECRET), LiveRequests(), Outbox("response-sender")
    try:
        ping = Request(["output_ids"], {PARAM_PING: True, PARAM_ENGINE_KEY: SECRET})
        model.execute([ping])
        deadline = time.monotonic() + 10
        while not ping.sender.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        ((answer, flags),) = ping.sender.sent
        assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and names(answer) == {"output_ids"}
        assert len(ENGINE_OUTPUTS) + len(ENGINE_EXTENSIONS) > 1  # so the engine's own response holds more
    finally:
        model.outbox.shutdown()
