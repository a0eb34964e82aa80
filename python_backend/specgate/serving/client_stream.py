"""What the client of one request sees, and the one thread that sends it.

The gate turns the engine's ids into text itself and answers the client directly: every response
holds the new text and all the gate's outputs (contract.LLM_OUTPUTS). A send is a synchronous round
trip through Triton (python_backend's `ResponseSender::Send` waits until the server has handled it),
so a request's serving thread never sends a streamed response: it records the engine's tokens in the
request's `ClientStream` and goes back to draining the engine, and the gate's one `Outbox` thread
sends what is waiting, one response per request however many engine responses came meanwhile. The
final response, or the error that ends a request, is the serving thread's, once the Outbox is done
with the request (docs/request-flow.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from specgate.gate import Route
from specgate.serving.outbox import Outbox
from specgate.serving.triton_io import FINAL, coded_error_response, tensor
from specgate.stats import SpecStats
from specgate.text.detokenizer import Decoder, delta_text

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0  # a last response waits this long at most for the Outbox's send of the request


class ClientStream:
    """One request's responses: the ids the engines made, the text of those already sent, the route,
    its reason and the draft statistics. `send` (the serving thread) records and, for a streamed
    request, schedules a flush on the Outbox; `finish` or `fail` (the serving thread) sends the last
    response once no flush is under way, and no flush sends after it."""

    def __init__(self, sender: Any, stream: bool, route: Route, reason: str, decoder: Decoder, outbox: Outbox) -> None:
        self.sender, self.stream, self.decoder, self.outbox = sender, stream, decoder, outbox
        self.route, self.reason = route, reason
        self.ids: list[int] = []
        self.stats = SpecStats()
        self.texted = 0  # of `ids`, those whose text went out (the Outbox's, then the final's)
        self.responses = 0  # sent, the final one included
        self._lock = threading.Condition()
        self._scheduled = False  # waiting in the Outbox or being sent by it
        self._closed = False

    def send(self, tokens: list[int], stats: SpecStats) -> None:
        with self._lock:
            self.ids += tokens
            self.stats = stats
            if not self.stream or self._scheduled or self._closed or len(self.ids) == self.texted:
                return
            self._scheduled = True
        self.outbox.schedule(self)

    def reroute(self, route: Route, reason: str, stats: SpecStats | None = None) -> None:
        """The request goes on on the other engine: its responses say so from here on."""
        with self._lock:
            self.route, self.reason = route, reason
            if stats is not None:
                self.stats = stats

    def flush(self) -> None:
        """Send what is waiting (the Outbox's thread)."""
        try:
            with self._lock:
                if self._closed:
                    return
                ids, outputs = list(self.ids), self._outputs()
            text = delta_text(self.decoder, ids, self.texted, final=False)
            if text:  # else the new tokens end inside a character: they go with the next ones
                self.sender.send(self._response(text, outputs))
                self.texted, self.responses = len(ids), self.responses + 1
        except Exception:  # the client is gone: the request ends at its next check
            log.warning("a streamed response failed", exc_info=True)
        finally:
            with self._lock:
                self._scheduled = False
                self._lock.notify_all()

    def finish(self) -> None:
        """The last response: the text not sent yet and the final counts."""
        with self._lock:
            self._close()
            ids, outputs = self.ids, self._outputs()
        self.sender.send(self._response(delta_text(self.decoder, ids, self.texted, final=True), outputs), flags=FINAL)
        self.texted, self.responses = len(ids), self.responses + 1

    def fail(self, code: str, message: str) -> None:
        """End the request with an error (`code` one of triton_io.ERROR_CODES), whatever went out before."""
        with self._lock:
            self._close()
        self.sender.send(coded_error_response(code, message), flags=FINAL)
        self.responses += 1

    def _close(self) -> None:
        """No flush after this one; waits for one queued or under way (holding the lock)."""
        self._closed = True
        if not self._lock.wait_for(lambda: not self._scheduled, timeout=CLOSE_WAIT_S):
            log.warning("the outbox did not get to a request in %.0f s: sending its last response beside it", CLOSE_WAIT_S)

    def _outputs(self) -> list[tuple[str, Any, Any]]:
        """The gate's outputs now, as (name, value, dtype) (under the lock)."""
        s = self.stats
        return [
            ("route", [self.route.value.encode()], np.object_),
            ("gate_reason", [self.reason.encode()], np.object_),
            ("num_draft_tokens", [s.draft_tokens], np.int32),
            ("num_accepted_tokens", [s.accepted_tokens], np.int32),
            ("acceptance_rate", [s.acceptance_rate], np.float32),
            ("num_output_tokens", [len(self.ids)], np.int32),
            ("draft_budget", [s.draft_budget], np.int32),
        ]

    @staticmethod
    def _response(text: str, outputs: list[tuple[str, Any, Any]]) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[tensor("text_output", [text.encode()], np.object_), *(tensor(*o) for o in outputs)]
        )
