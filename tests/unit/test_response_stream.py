"""serving/engine_model.ResponseStream's cancellation flag: set by the gate's stop message
(`cancel`, on the execute thread) or read from Triton (`is_cancelled`, on the decode thread)."""

from __future__ import annotations

from typing import Any

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.serving.engine_model import ResponseStream  # noqa: E402


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
