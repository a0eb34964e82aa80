"""serving/live_requests: a cancel message finds its request, also when it arrives first."""

from __future__ import annotations

from specgate.serving.live_requests import LiveRequests


class Request:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_cancel_finds_the_request_by_key() -> None:
    live, a, b = LiveRequests(), Request(), Request()
    live.add("a", a)
    live.add("b", b)
    live.cancel("a")
    assert a.cancelled and not b.cancelled


def test_a_cancel_before_its_request_applies_when_it_arrives() -> None:
    live, a = LiveRequests(), Request()
    live.cancel("a")
    live.add("a", a)
    assert a.cancelled
    again = Request()
    live.discard("a")
    live.add("a", again)  # applied once, not to a later request with the same key
    assert not again.cancelled


def test_a_finished_request_is_not_cancelled_and_early_cancels_are_bounded() -> None:
    live, a = LiveRequests(remember=2), Request()
    live.add("a", a)
    live.discard("a")
    live.cancel("a")  # too late: remembered as early, harmless
    assert not a.cancelled
    for key in ("x", "y", "z"):
        live.cancel(key)
    late = Request()
    live.add("a", late)  # "a" was pushed out by x, y, z
    assert not late.cancelled
    z = Request()
    live.add("z", z)
    assert z.cancelled
