"""An engine's running requests by the key the gate gave each (contract.PARAM_REQUEST_KEY), for its
cancel messages (contract.PARAM_CANCEL)."""

from __future__ import annotations

import collections
import threading
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class LiveRequests:
    """Finds the request a cancel message (PARAM_CANCEL) names. BLS requests from different gate
    threads arrive in no set order, so a cancel that comes before its request is remembered (the
    latest `remember` of them) and applied when the request arrives."""

    def __init__(self, remember: int = 256) -> None:
        self._live: dict[str, Cancellable] = {}
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()

    def add(self, key: str, request: Cancellable) -> None:
        with self._lock:
            if key in self._early:
                del self._early[key]
                request.cancel()
            self._live[key] = request

    def discard(self, key: str) -> None:
        with self._lock:
            self._live.pop(key, None)

    def cancel(self, key: str) -> bool:
        """Cancel the request `key`; False if it has not arrived (then it is cancelled on arrival)."""
        with self._lock:
            request = self._live.get(key)
            if request is not None:
                request.cancel()
                return True
            self._early[key] = None
            if len(self._early) > self._remember:
                self._early.popitem(last=False)
            return False
