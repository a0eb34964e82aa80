"""The one thread of a model that sends its streamed responses.

A send is a synchronous round trip through Triton (python_backend's `ResponseSender::Send` waits
until the server has handled it), so the threads that make responses (the engine's decode loop, the
gate's serving threads) only record them in the request's stream and schedule it here; this thread
sends what each scheduled stream has waiting, in order per stream. The gate's `ClientStream` and the
engine's `ResponseStream` use it alike.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol


class Flushable(Protocol):
    def flush(self) -> None:
        """Send what the stream has waiting (called on the Outbox's thread)."""


class Outbox:
    """Bounded: a stream waits in the queue at most once (it keeps a flag from `schedule` to the end
    of its `flush`), so the queue holds no more entries than there are requests."""

    def __init__(self, name: str) -> None:
        self._q: queue.Queue[Flushable | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def schedule(self, stream: Flushable) -> None:
        self._q.put(stream)

    def shutdown(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (stream := self._q.get()) is not None:
            stream.flush()
