"""Admission to the gate: a bounded number of requests served at once, a bounded queue behind them.

At most `admission.max_concurrent` requests are served at once; up to `admission.max_queued` more
wait, in arrival order, at most `admission.queue_timeout_s` each. A request past either bound is
refused as overloaded (the adapter answers UNAVAILABLE: HTTP 503), so a burst cannot grow threads,
memory and waiting time without limit, and a client learns at once that it should back off.

    ticket = queue.enter()     # non-blocking: admitted or queued; Overloaded when the queue is full
    queue.wait(ticket, tick)   # on the serving thread: blocks until admitted; Overloaded on timeout;
                               # tick() runs every TICK_S meanwhile (it may raise to give up the place)
    ...serve...
    queue.leave(ticket)        # always, once: frees the slot (to the next in line) or the place

Limits are read from the live policy at each call, so an edit applies to the next arrival.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specgate.gate.metrics import QUEUE_FULL, QUEUE_TIMEOUT, GateMetrics
from specgate.gate.policy import AdmissionPolicy

TICK_S = 0.2  # how often a queued request's `tick` runs


class Overloaded(Exception):
    """The request was not admitted; `reason` is the spec_gate_overloaded_total label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"overloaded: {message}; retry later")
        self.reason = reason


@dataclass(eq=False)
class Ticket:
    timeout_s: float
    deadline: float
    admitted: bool = False
    left: bool = False
    turn: threading.Event = field(default_factory=threading.Event)  # set when admitted from the queue


class AdmissionQueue:
    def __init__(self, limits: Callable[[], AdmissionPolicy], metrics: GateMetrics) -> None:
        self._limits = limits
        self._metrics = metrics
        self._lock = threading.Lock()
        self._running = 0
        self._waiting: collections.deque[Ticket] = collections.deque()

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def enter(self) -> Ticket:
        limits = self._limits()
        with self._lock:
            self._admit_waiting(limits)  # a raised max_concurrent applies to those already waiting
            ticket = Ticket(limits.queue_timeout_s, time.monotonic() + limits.queue_timeout_s)
            if self._running < limits.max_concurrent and not self._waiting:
                self._running += 1
                ticket.admitted = True
            elif len(self._waiting) < limits.max_queued:
                self._waiting.append(ticket)
            else:
                self._metrics.overloaded(QUEUE_FULL)
                raise Overloaded(QUEUE_FULL, f"{len(self._waiting)} requests already queued (admission.max_queued)")
            self._metrics.queued(len(self._waiting))
        return ticket

    def wait(self, ticket: Ticket, tick: Callable[[], None] = lambda: None) -> None:
        """Until `ticket` is admitted. `tick` runs every TICK_S of the wait: a request queued here
        still has a client to look after (the gate's heartbeats, by which it learns that the client
        left); an exception from it ends the wait, and the caller's `leave` frees the place."""
        while not ticket.admitted:
            left_s = ticket.deadline - time.monotonic()
            if left_s <= 0 or ticket.turn.wait(min(TICK_S, left_s)):
                break
            tick()
        if ticket.admitted:
            return
        with self._lock:
            if ticket.admitted:  # admitted just as the wait timed out
                return
            self._waiting.remove(ticket)
            ticket.left = True
            self._metrics.queued(len(self._waiting))
            self._metrics.overloaded(QUEUE_TIMEOUT)
        raise Overloaded(QUEUE_TIMEOUT, f"no free slot within {ticket.timeout_s:g} s (admission.queue_timeout_s)")

    def leave(self, ticket: Ticket) -> None:
        limits = self._limits()
        with self._lock:
            if ticket.left:
                return
            ticket.left = True
            if ticket.admitted:
                self._running -= 1
            else:
                self._waiting.remove(ticket)
            self._admit_waiting(limits)
            self._metrics.queued(len(self._waiting))

    def _admit_waiting(self, limits: AdmissionPolicy) -> None:
        """First in, first admitted, while there are free slots; callers hold the lock."""
        while self._waiting and self._running < limits.max_concurrent:
            ticket = self._waiting.popleft()
            ticket.admitted = True
            self._running += 1
            ticket.turn.set()
