"""The gate's admission queue: bounded concurrency, a bounded FIFO queue, a timeout, all counted."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from specgate.gate import Gate
from specgate.gate.admission import Overloaded
from specgate.gate.metrics import InMemoryMetricFactory


def _gate(tmp_path: Path, max_concurrent: int = 2, max_queued: int = 2, timeout_s: float = 5.0) -> tuple[Gate, InMemoryMetricFactory]:
    path = tmp_path / "policy.yaml"
    path.write_text(f"admission: {{max_concurrent: {max_concurrent}, max_queued: {max_queued}, queue_timeout_s: {timeout_s}}}\n")
    pb = InMemoryMetricFactory()
    return Gate(str(path), metric_factory=pb, reload_interval_s=0.0), pb


def test_refuses_past_the_queue_and_counts_it(tmp_path: Path) -> None:
    gate, pb = _gate(tmp_path)
    q = gate.admission
    running = [q.enter(), q.enter()]
    queued = [q.enter(), q.enter()]
    assert all(t.admitted for t in running) and not any(t.admitted for t in queued)
    assert (q.running, q.queued) == (2, 2)
    with pytest.raises(Overloaded, match=r"overloaded: 2 requests already queued \(admission.max_queued\); retry later") as err:
        q.enter()
    assert err.value.reason == "queue_full"
    assert pb.families["spec_gate_overloaded_total"].value(reason="queue_full") == 1
    assert pb.families["spec_gate_queued"].value() == 2


def test_a_freed_slot_goes_to_the_first_in_line(tmp_path: Path) -> None:
    gate, pb = _gate(tmp_path, max_concurrent=1)
    q = gate.admission
    first, second, third = q.enter(), q.enter(), q.enter()
    q.leave(first)
    assert second.admitted and not third.admitted
    q.wait(second)  # returns at once
    q.leave(third)  # a queued request that gives up frees its place
    assert (q.running, q.queued) == (1, 0) and pb.families["spec_gate_queued"].value() == 0
    q.leave(third)  # leaving twice changes nothing
    q.leave(second)
    assert (q.running, q.queued) == (0, 0)


def test_a_queued_request_times_out_and_is_counted(tmp_path: Path) -> None:
    gate, pb = _gate(tmp_path, max_concurrent=1, timeout_s=0.2)
    q = gate.admission
    busy, waiting = q.enter(), q.enter()
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match=r"no free slot within 0.2 s \(admission.queue_timeout_s\)") as err:
        q.wait(waiting)
    assert err.value.reason == "queue_timeout" and 0.15 < time.monotonic() - t0 < 2.0
    assert q.queued == 0 and pb.families["spec_gate_overloaded_total"].value(reason="queue_timeout") == 1
    q.leave(waiting)  # the adapter always leaves: no effect after a timeout
    q.leave(busy)
    assert q.running == 0


def test_a_raised_limit_admits_those_already_waiting(tmp_path: Path) -> None:
    gate, _ = _gate(tmp_path, max_concurrent=1)
    q = gate.admission
    q.enter()
    waiting = q.enter()
    path = tmp_path / "policy.yaml"
    path.write_text("admission: {max_concurrent: 3, max_queued: 2}\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    late = q.enter()
    assert waiting.admitted and late.admitted and q.running == 3


def test_never_more_than_max_concurrent_at_once(tmp_path: Path) -> None:
    gate, _ = _gate(tmp_path, max_concurrent=3, max_queued=40)
    q, lock = gate.admission, threading.Lock()
    now, peak, served = [0], [0], []

    def request(i: int) -> None:
        ticket = q.enter()
        try:
            q.wait(ticket)
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            time.sleep(0.01)
            with lock:
                now[0] -= 1
            served.append(i)
        finally:
            q.leave(ticket)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 3 and sorted(served) == list(range(40)) and (q.running, q.queued) == (0, 0)
