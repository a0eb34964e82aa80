"""The intake's ticks (serving/watch.py): how often they go out, and intakes whose serving step never came."""

from __future__ import annotations

import time

import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.serving import watch  # noqa: E402
from specgate.serving.watch import Watches  # noqa: E402

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Request:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _ticks(sender: pb.ResponseSender) -> int:
    return sum(1 for r, _ in sender.sent if r is not None)


def test_ticks_are_rationed_when_many_requests_are_open() -> None:
    """Each tick is a step of the gate's: one request gets one every TICK_S, many share TICKS_PER_S."""
    w = Watches()
    try:
        one = pb.ResponseSender()
        w.open(1, one, Request())
        w.serving(1)
        time.sleep(1.0)
        assert 0.7 / watch.TICK_S <= _ticks(one) <= 1.2 / watch.TICK_S
        w.close(1)
        many = {k: pb.ResponseSender() for k in range(2, 42)}  # 40 open: each every 2 s
        for k, sender in many.items():
            w.open(k, sender, Request())
            w.serving(k)
        # the first ticks fall within an interval that grew as they opened one by one: count the rate after them
        time.sleep(2.2)
        assert all(_ticks(s) >= 1 for s in many.values()), "a request went without ticks"
        before = sum(_ticks(s) for s in many.values())
        time.sleep(4.0)
        ticks = sum(_ticks(s) for s in many.values()) - before
        assert ticks <= 4.0 * watch.TICKS_PER_S * 1.1, f"{ticks} ticks in 4 s"
    finally:
        w.shutdown()


def test_a_cancelled_tick_cancels_its_request_and_close_ends_the_intake() -> None:
    w = Watches()
    try:
        sender, request = pb.ResponseSender(), Request()
        w.open(7, sender, request)
        assert w.serving(7) is request and w.serving(8) is None
        w.answered(7, cancelled=False)
        assert not request.cancelled
        w.answered(7, cancelled=True)
        assert request.cancelled
        w.close(7)
        w.close(7)  # once only
        assert [flags for r, flags in sender.sent if r is None] == [FINAL]
        assert w.serving(7) is None
    finally:
        w.shutdown()


def test_an_intake_whose_serving_step_never_came_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the ensemble request would stay open for ever (Triton could not schedule the step)."""
    monkeypatch.setattr(watch, "SERVE_WAIT_S", 0.3)
    w = Watches()
    try:
        sender = pb.ResponseSender()
        w.open(9, sender, Request())
        deadline = time.monotonic() + 5
        while not sender.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.sent == [(None, FINAL)]
        assert w.serving(9) is None
    finally:
        w.shutdown()
