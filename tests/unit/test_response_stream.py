"""serving/engine_model.ResponseStream: its cancellation flag, set by the gate's stop message
(`cancel`, on the execute thread) or read from Triton (`is_cancelled`, on the decode thread), and
which tensors its streamed responses carry."""

from __future__ import annotations

from typing import Any

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.cost_model.stream_pacer import StreamPacer  # noqa: E402
from specgate.decoding.request import Event  # noqa: E402
from specgate.serving.engine_model import ResponseStream  # noqa: E402
from specgate.stats import SpecStats  # noqa: E402


class Sender:
    """Triton's flag for a BLS request from the gate: never set (Triton cannot cancel one)."""

    def __init__(self) -> None:
        self.during_ipc: Any = None  # runs while is_cancelled's IPC is under way

    def is_cancelled(self) -> bool:
        if self.during_ipc is not None:
            self.during_ipc()
        return False


def test_a_stop_from_the_gate_during_the_flag_ipc_is_kept() -> None:
    """The gate's stop arrived while the decode thread asked Triton, whose answer (False) overwrote
    it: the engine ran the request to max_tokens. The cancellation flake of test_cancellation.py
    (docs/robustness.md): the gate counted the cancellation, target_engine did not, 400 of 400 tokens."""
    sender = Sender()
    stream = ResponseStream(sender, streaming=True, outbox=None)  # type: ignore[arg-type]
    sender.during_ipc = stream.cancel
    assert stream.is_cancelled()


def test_triton_s_flag_is_read() -> None:
    sender = Sender()
    sender.is_cancelled = lambda: True  # type: ignore[method-assign]
    stream = ResponseStream(sender, streaming=True, outbox=None)  # type: ignore[arg-type]
    assert stream.is_cancelled()


class Outbox:
    """The Outbox without its thread: a due stream is flushed at once."""

    def schedule(self, stream: ResponseStream) -> None:
        stream.flush()


def test_draft_statistics_travel_only_when_they_change_and_the_gate_still_reads_them_all() -> None:
    """Each tensor of a response is copied by this stub, Triton and the gate on the decoding cores, so
    a streamed response carries the statistics only where they changed (and always the final one).
    What the gate reads from the stream (SpecStats.from_response keeps the last it saw) must be, after
    every response, the statistics of the event that response stands for."""
    sender = pb.ResponseSender()
    stream = ResponseStream(sender, streaming=True, outbox=Outbox())  # type: ignore[arg-type]
    drafting = SpecStats(draft_budget=3)
    drafted = SpecStats(num_drafts=1, draft_tokens=3, accepted_tokens=2, accepted_per_position=[1, 1], draft_budget=3, modelled_speedup=1.5)
    events = [
        Event([5]),  # the baseline: no statistics at all
        Event([6]),
        Event([7], stats=drafting),
        Event([8], stats=drafting),
        Event([9], stats=drafted),
        Event([], finished=True, stats=drafted),
    ]
    read, carried = SpecStats(), []
    for ev in events:
        stream(ev)
        response, _ = sender.sent[-1]
        carried.append(pb.get_output_tensor_by_name(response, "total_draft_tokens") is not None)
        read = SpecStats.from_response(lambda name: _numpy(response, name), read)
        assert read == (ev.stats or SpecStats())
        assert pb.get_output_tensor_by_name(response, "output_ids").as_numpy().reshape(-1).tolist() == ev.tokens
    assert carried == [False, False, True, False, True, True]
    assert len(sender.sent) == len(events)


def _numpy(response: Any, name: str) -> Any:
    t = pb.get_output_tensor_by_name(response, name)
    return None if t is None else t.as_numpy()


def test_a_paced_stream_sends_when_due_and_reports_each_response_to_its_pacer() -> None:
    """The pacer learns from the responses it is told of, and only while a stream is open (from its
    first event to its last): a stream that forgot either would teach it a wrong cost."""
    sender = pb.ResponseSender()
    pacer = StreamPacer()  # measuring: before its first fit, a response at most every START_INTERVAL_MS
    stream = ResponseStream(sender, streaming=True, outbox=Outbox(), pacer=pacer)  # type: ignore[arg-type]
    assert pacer._streams == 0
    for tok in (5, 6, 7):
        stream(Event([tok]))
    assert pacer._streams == 1
    stream(Event([8], finished=True))
    sent = [pb.get_output_tensor_by_name(r, "output_ids").as_numpy().reshape(-1).tolist() for r, _ in sender.sent]
    assert sent == [[5], [6, 7, 8]]  # the first at once, the rest held until the last
    assert pacer._sends == 2 and pacer._streams == 0


def test_a_probe_s_hold_never_delays_a_stream_s_first_tokens() -> None:
    """The pacer holds every stream's responses for a few decodes now and then (its probes); a request
    whose first tokens fell into one waited for them: its time to first token grew by the hold.
    (A CI run saw the gate's load hand-over test fail this way: the first request had ended by the
    time its first tokens reached the client.)"""
    sender = pb.ResponseSender()
    pacer = StreamPacer()
    pacer._hold_until = pacer._count + 4  # a probe under way
    assert not pacer.due(0.0, 1.0)  # a stream that has sent waits, however long ago it sent
    stream = ResponseStream(sender, streaming=True, outbox=Outbox(), pacer=pacer)  # type: ignore[arg-type]
    stream(Event([5]))
    stream(Event([6]))
    sent = [pb.get_output_tensor_by_name(r, "output_ids").as_numpy().reshape(-1).tolist() for r, _ in sender.sent]
    assert sent == [[5]]  # the first at once, the second held
