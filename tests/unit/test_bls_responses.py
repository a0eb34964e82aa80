"""serving/bls.responses: how the gate waits on an engine. Cancellation ends the wait within a tick
even while the engine is silent; a silent engine is probed, and the probe's failure ends it; a
dead engine that never answers hits the stall timeout; responses pass through in order."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from specgate.serving import bls
from specgate.serving.bls import Cancelled, EngineFailure, responses


class FakeRequest:
    """A BLS request whose responses the test feeds through `q` (None ends it)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def exec(self, decoupled: bool) -> object:  # noqa: A003 (pb_utils' name)
        assert decoupled

        def it():
            while (item := self.q.get()) is not None:
                yield item

        return it()


def test_responses_pass_through_in_order() -> None:
    req = FakeRequest()
    for r in ("a", "b", "c", None):
        req.q.put(r)
    got = [r for batch in responses(req, "engine") for r in batch]
    assert got == ["a", "b", "c"]


def test_cancel_ends_a_silent_wait_within_a_tick() -> None:
    req, cancel = FakeRequest(), threading.Event()
    threading.Timer(0.3, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(Cancelled):
        for _ in responses(req, "engine", cancelled=cancel):
            pass
    assert time.monotonic() - start < 0.3 + 2 * bls.TICK_S
    req.q.put(None)  # let the pump thread end


def test_cancel_is_checked_before_each_batch() -> None:
    req, cancel = FakeRequest(), threading.Event()
    req.q.put("first")
    seen = []
    with pytest.raises(Cancelled):
        for batch in responses(req, "engine", cancelled=cancel):
            seen += batch
            cancel.set()
            req.q.put("second")
    assert seen == ["first"]
    req.q.put(None)


def test_a_silent_engine_is_probed_and_a_failed_probe_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.3)
    req, probes = FakeRequest(), []

    def probe() -> None:
        probes.append(time.monotonic())
        if len(probes) == 2:
            raise EngineFailure("engine is not answering")

    with pytest.raises(EngineFailure, match="not answering"):
        for _ in responses(req, "engine", probe=probe):
            pass
    assert len(probes) == 2 and probes[1] - probes[0] >= 0.3  # once per silence, not every tick
    req.q.put(None)


def test_a_talking_engine_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.3)
    req = FakeRequest()

    def talk() -> None:
        for i in range(8):
            req.q.put(i)
            time.sleep(0.1)
        req.q.put(None)

    threading.Thread(target=talk).start()
    got = [r for batch in responses(req, "engine", probe=lambda: pytest.fail("probed a talking engine")) for r in batch]
    assert got == list(range(8))


def test_stall_timeout() -> None:
    req = FakeRequest()
    with pytest.raises(EngineFailure, match="no response for 0 s"):
        for _ in responses(req, "engine", stall_s=0.3):
            pass
    req.q.put(None)


def test_an_exec_error_is_raised_on_the_callers_thread() -> None:
    class Failing:
        def exec(self, decoupled: bool) -> object:  # noqa: A003
            raise RuntimeError("unknown model")

    with pytest.raises(RuntimeError, match="unknown model"):
        for _ in responses(Failing(), "engine"):
            pass


def test_a_slow_engine_that_answers_probes_is_not_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: a non-streamed request hears nothing until its end. An engine slower than the stall
    timeout that answers every probe is alive; before, the stall check ignored the probes and failed it."""
    monkeypatch.setattr(bls, "PROBE_AFTER_S", 0.1)
    req, probes = FakeRequest(), []
    threading.Timer(1.5, lambda: [req.q.put("done"), req.q.put(None)]).start()  # three stall timeouts of silence
    got = [r for batch in responses(req, "engine", stall_s=0.5, probe=lambda: probes.append(1)) for r in batch]
    assert got == ["done"] and probes
