"""Decoupled BLS calls from a Python-backend model: their responses, watched, and kept alive.

`responses()` drains a BLS request on a thread of its own (its iterator blocks forever when the
called model's stub process dies mid-request, and that thread is then abandoned) and hands the
caller its responses in lists, while it watches for a cancelled request, a silence past a stall
timeout, and a silent engine that may be gone (`probe`).

`KEEPALIVE` holds every finished request and iterator a while (see `Keepalive`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Iterator

TICK_S = 0.2  # how often a waiting caller looks at its cancel flag
PROBE_AFTER_S = 3.0  # silence after which `probe` asks whether the engine is still there


class EngineFailure(RuntimeError):
    """The engine failed (not the client's fault): fall back if possible."""


class Silent(EngineFailure):
    """The engine gave no sign of life for the whole time allowed."""


class Cancelled(Exception):
    """The client cancelled the request: stop serving it."""


class Keepalive:
    """Holds each finished BLS request and its response iterator for `hold_s` before Python drops them.

    Why (from the backend's source, and a soak test that crashed the stub within two minutes
    without this): the stub's cleanup thread also holds every decoupled BLS response iterator and
    releases it without the GIL. If Python has dropped its reference
    first, the iterator and its responses' numpy arrays are freed on that thread, which corrupts
    the interpreter's heap (`malloc(): unaligned fastbin chunk detected`, segfaults in libpython;
    later backends take the GIL in the tensor destructor). Dropping our reference well after the
    cleanup thread has let go (it does so within milliseconds of the final response) makes the free
    happen here, under the GIL.
    """

    def __init__(self, hold_s: float = 5.0) -> None:
        self.hold_s = hold_s
        self._held: collections.deque[tuple[float, Any]] = collections.deque()
        self._lock = threading.Lock()

    def hold(self, *objs: Any) -> None:
        now = time.monotonic()
        with self._lock:
            self._held.append((now + self.hold_s, objs))
            expired = []
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        del expired  # freed here, by a Python thread that holds the GIL


KEEPALIVE = Keepalive()

_DONE = object()


def responses(
    req: Any,
    engine: str,
    stall_s: float | None = None,
    cancelled: threading.Event | None = None,
    probe: Callable[[], None] | None = None,
) -> Iterator[list[Any]]:
    """The BLS responses of `req`, in lists of those that arrived while the previous list was being
    forwarded (so a slow client path gets fewer, larger responses instead of a growing backlog).

    Raises Cancelled once `cancelled` is set (checked every TICK_S and before each list),
    Silent (an EngineFailure) if the engine gives no sign of life for `stall_s` seconds (None: no limit), and
    whatever `probe` raises, which is called after every PROBE_AFTER_S of silence. A probe that
    returns is a sign of life: a slow engine that answers it is not stalled (a non-streamed request
    hears nothing else until its end).
    """
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        it = None
        try:
            it = req.exec(decoupled=True)
            for r in it:
                q.put(r)
        except Exception as exc:  # re-raised on the caller's thread
            q.put(exc)
        finally:
            KEEPALIVE.hold(req, it)
        q.put(_DONE)

    threading.Thread(target=pump, name=f"bls-{engine}", daemon=True).start()
    heard = time.monotonic()  # the latest response, or answered probe
    while True:
        if cancelled is not None and cancelled.is_set():
            raise Cancelled()
        try:
            items = [q.get(timeout=TICK_S)]
        except queue.Empty:
            now = time.monotonic()
            if stall_s is not None and now - heard > stall_s:
                raise Silent(f"{engine}: no response for {stall_s:.0f} s") from None
            if probe is not None and now - heard > PROBE_AFTER_S:
                probe()
                heard = time.monotonic()  # it answered: alive, only slow
            continue
        heard = time.monotonic()
        while not q.empty():
            items.append(q.get_nowait())
        batch = [i for i in items if i is not _DONE and not isinstance(i, Exception)]
        if batch:
            yield batch
        for item in items:
            if isinstance(item, Exception):
                raise item
            if item is _DONE:
                return
