"""The client-facing stream of one request through spec_gate: what postprocessing and the client see."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from specgate.contract import GATE_STATE_TENSOR, GateState
from specgate.serving.triton_io import FINAL, coded_error_response, tensor
from specgate.stats import SpecStats


HEARTBEAT_S = 1.0  # silence towards postprocessing after which a heartbeat goes out


class ClientStream:
    """Cumulative ids for postprocessing, the route, its reason and the draft statistics. Every
    response carries the request's key, which postprocessing sends back if the client cancels.

    Postprocessing can only see a cancellation on a response that reaches it, and a non-streamed
    request (or a streamed one whose engine is silent) sends none until its end: `heartbeat`, called
    while the gate waits on an engine, then sends an empty one (contract.TO_POSTPROCESSING), which
    postprocessing looks at and swallows.

    An error after a response went out travels as data in a final response, which postprocessing
    turns into the error (contract.GateState.error says why)."""

    def __init__(self, sender: Any, stream: bool, route: str, reason: str, key: int) -> None:
        self.sender, self.stream = sender, stream
        self.route, self.reason = route, reason
        self.key = key
        self.ids: list[int] = []
        self.prev = 0
        self.stats = SpecStats()
        self.last_sent = time.monotonic()
        self.sent = False  # any response went to postprocessing

    def send(self, tokens: list[int], stats: SpecStats) -> None:
        self.ids += tokens
        self.stats = stats
        if self.stream and len(self.ids) > self.prev:
            self.sender.send(self._response(False))
            self.prev = len(self.ids)
            self.last_sent = time.monotonic()
            self.sent = True

    def heartbeat(self) -> None:
        """An empty response if nothing went out for HEARTBEAT_S."""
        now = time.monotonic()
        if now - self.last_sent >= HEARTBEAT_S:
            self.sender.send(self._response(False, heartbeat=True))
            self.last_sent = now
            self.sent = True

    def finish(self) -> None:
        self.sender.send(self._response(True), flags=FINAL)

    def fail(self, code: str, message: str) -> None:
        """End the request with an error (`code` one of triton_io.ERROR_CODES): as an error response
        while nothing went out yet, else as data in the final response (class doc)."""
        if self.sent:
            self.sender.send(self._response(True, error=(code, message)), flags=FINAL)
        else:
            self.sender.send(coded_error_response(code, message), flags=FINAL)

    def _response(self, final: bool, heartbeat: bool = False, error: tuple[str, str] = ("", "")) -> Any:
        s = self.stats
        state = GateState(
            prev_output_length=0 if heartbeat else self.prev, is_final=final, request_key=self.key, error=error,
            route=self.route, gate_reason=self.reason, num_draft_tokens=s.draft_tokens, num_accepted_tokens=s.accepted_tokens,
            acceptance_rate=s.acceptance_rate, num_output_tokens=len(self.ids), draft_budget=s.draft_budget,
        )
        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("output_ids", [] if heartbeat else self.ids, np.int32),  # no ids and prev 0: a heartbeat
                tensor(GATE_STATE_TENSOR, [state.model_dump_json().encode()], np.object_),
            ]
        )
