"""How the gate learns that a client left: the intake step's ticks (contract.GATE_TICK).

Triton 2.51 tells no running step of an ensemble that its client cancelled; it marks each step it
schedules afterwards as cancelled. So the gate's intake step, the first of its two `llm` steps, stays
open while its request is served and sends a tick every so often; each tick is a short serving step
of its own, which the gate answers at once (`GateModel`) after asking Triton whether it was
cancelled, and `Watches.answered` cancels the request if it was.

A tick costs the gate a step, so ticks are rationed: every TICK_S per request while few are open, at
most TICKS_PER_S in all beyond that (eight open requests: one each 0.4 s). The engines are slower
per request when many share a batch, so a cancellation is still seen within a few tokens of output.

`close` ends the intake. Before an error response it also waits until every tick sent has been
answered: Triton 2.51's ensemble never completes a request one of whose steps sends an error while
another of its steps is in flight (core's EnsembleContext::PrepareSteps; fixed upstream in core
PR 466), and the ticks are steps of the same request.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from specgate.contract import GATE_TICK
from specgate.serving.live_requests import Cancellable
from specgate.serving.triton_io import FINAL, tensor

log = logging.getLogger(__name__)

TICK_S = 0.1  # between two ticks of one request, while few are open
TICKS_PER_S = 20.0  # ticks in all, beyond which each request's ticks are spread out
SERVE_WAIT_S = 60.0  # an intake whose serving step never came is closed after this (Triton could not schedule it)
DRAIN_S = 10.0  # the longest `close` waits for the answers to ticks in flight


def tick_response(key: int, n: int) -> Any:
    """The intake's response [key, n]: n = 0 schedules the serving step, n > 0 a tick."""
    return pb_utils.InferenceResponse(output_tensors=[tensor(GATE_TICK.name, [key, n], np.int64)])


@dataclass
class Intake:
    """One request's open intake step."""

    sender: Any
    request: Cancellable  # what the serving step serves; cancelled by a cancelled tick
    opened: float
    serving: bool = False  # its serving step arrived: ticks go out
    closed: bool = False
    sent: int = 0  # ticks
    answered: int = 0
    due: float = 0.0  # the next tick
    lock: threading.Condition = field(default_factory=threading.Condition)


class Watches:
    """The open intakes by request key, and the thread that ticks them."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._intakes: dict[int, Intake] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gate-ticks", daemon=True)
        self._thread.start()

    def open(self, key: int, sender: Any, request: Cancellable) -> None:
        """A request's intake, about to send its first response (n = 0)."""
        with self._lock:
            self._intakes[key] = Intake(sender, request, self._now())

    def serving(self, key: int) -> Cancellable | None:
        """Its serving step arrived: tick from now on. Returns the request `open` was given; None for
        a key that has no open intake."""
        intake = self._get(key)
        if intake is None:
            return None
        with intake.lock:  # the first tick at a random point of the interval: requests that came together tick apart
            intake.serving, intake.due = True, self._now() + random.uniform(TICK_S, self._interval())
        return intake.request

    def answered(self, key: int, cancelled: bool) -> None:
        """A tick was answered (its final flag sent); `cancelled`: Triton had marked it cancelled."""
        intake = self._get(key)
        if intake is None:
            return
        with intake.lock:
            intake.answered += 1
            intake.lock.notify_all()
        if cancelled:
            intake.request.cancel()

    def close(self, key: int, drain: bool = False) -> None:
        """End the request's intake (no more ticks; its final flag); with `drain`, return only once
        every tick sent has been answered. A key without an open intake: nothing to do."""
        intake = self._get(key)
        if intake is None:
            return
        try:
            with intake.lock:
                if intake.closed:
                    return
                intake.closed = True
                intake.sender.send(flags=FINAL)
                if drain and not intake.lock.wait_for(lambda: intake.answered >= intake.sent, timeout=DRAIN_S):
                    log.warning("%d of %d ticks unanswered after %.0f s", intake.sent - intake.answered, intake.sent, DRAIN_S)
        finally:  # kept until now: the answers to its last ticks count
            with self._lock:
                self._intakes.pop(key, None)

    def shutdown(self) -> None:
        self._stop.set()

    def _interval(self) -> float:
        """Between two ticks of one request, now."""
        with self._lock:
            return max(TICK_S, len(self._intakes) / TICKS_PER_S)

    def _get(self, key: int) -> Intake | None:
        with self._lock:
            return self._intakes.get(key)

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S / 2):
            with self._lock:
                open_ = list(self._intakes.items())
            interval, now = self._interval(), self._now()
            for key, intake in open_:
                if not intake.serving and now - intake.opened > SERVE_WAIT_S:
                    log.warning("request %x: no serving step after %.0f s; closing its intake", key, SERVE_WAIT_S)
                    self.close(key)
                else:
                    self._tick(key, intake, now, interval)

    def _tick(self, key: int, intake: Intake, now: float, interval: float) -> None:
        with intake.lock:
            if intake.closed or not intake.serving or now < intake.due:
                return
            intake.due = now + interval
            try:
                intake.sender.send(tick_response(key, intake.sent + 1))
                intake.sent += 1
            except Exception:  # the request is gone from Triton; its serving step ends it
                log.warning("a tick failed", exc_info=True)
