"""One `llm` request in spec_gate, from its intake to its last response: what every serving method reads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from specgate.gate import Decision
from specgate.gate.admission import Ticket
from specgate.serving.bls import Cancelled
from specgate.serving.client_stream import ClientStream
from specgate.serving.llm_request import LLMRequest


@dataclass(eq=False)
class RequestContext:
    """What the intake read (the knobs, the prompt, the stop words), the key its ticks name, and, from
    admission on (`admit`), the gate's decision, the admission ticket and the client's stream."""

    llm: LLMRequest
    prompt: list[int]
    stops: np.ndarray | None
    key: int
    cancelled: threading.Event = field(default_factory=threading.Event)  # the client left
    decision: Decision = field(init=False)
    ticket: Ticket = field(init=False)
    out: ClientStream = field(init=False)

    def admit(self, decision: Decision, ticket: Ticket, out: ClientStream) -> None:
        self.decision, self.ticket, self.out = decision, ticket, out

    def cancel(self) -> None:
        """A tick found the client gone (watch.Watches), or it was gone when serving began."""
        self.cancelled.set()

    def check_cancelled(self) -> None:
        """Raise Cancelled if the client left (while queued for admission)."""
        if self.cancelled.is_set():
            raise Cancelled()

    def continuation(self) -> list[int]:
        """What another engine continues from: the prompt and the output so far."""
        return self.prompt + self.out.ids
