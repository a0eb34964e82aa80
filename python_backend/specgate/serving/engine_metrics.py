"""What an engine model exports on Triton's metrics port, labelled with the model's name.

Updated off the decode thread: when a request is accepted (the model's execute thread) and when its
final response goes out (the response-sender thread). The KV figure is the one the runner read from
the target on its own thread right after the request let go of its slot (Event.cached_tokens).
"""

from __future__ import annotations

import threading
from typing import Any

from specgate.contract import (
    ENGINE_ACTIVE_METRIC,
    ENGINE_CANCELLED_METRIC,
    ENGINE_KV_METRIC,
    ENGINE_RESPONSE_COST_METRIC,
    ENGINE_STREAM_INTERVAL_METRIC,
    ENGINE_TOKENS_METRIC,
)
from specgate.cost_model.stream_pacer import Pace


class EngineMetrics:
    def __init__(self, factory: Any, model: str) -> None:
        """`factory`: `triton_python_backend_utils` (or a fake with its MetricFamily shape)."""
        mf = factory.MetricFamily
        self._families: list[Any] = []  # a family that Python drops is unregistered with it

        def metric(name: str, description: str, kind: Any) -> Any:
            family = mf(name=name, description=description, kind=kind)
            self._families.append(family)
            return family.Metric(labels={"model": model})

        self._active = metric(ENGINE_ACTIVE_METRIC, "Requests accepted by the engine and not finished", mf.GAUGE)
        self._kv = metric(ENGINE_KV_METRIC, "Tokens held in the engine's KV cache when its latest request ended", mf.GAUGE)
        self._tokens = metric(ENGINE_TOKENS_METRIC, "Tokens the engine generated", mf.COUNTER)
        self._cancelled = metric(ENGINE_CANCELLED_METRIC, "Requests the engine stopped because they were cancelled", mf.COUNTER)
        self._interval = metric(ENGINE_STREAM_INTERVAL_METRIC, "How often the engine sends a streamed response at most, "
                                "with one stream open (N streams: N times that, within 0.1 s)", mf.GAUGE)
        # its sample appears with the first measurement: a gauge never set would read 0, "free"
        self._cost_family = mf(name=ENGINE_RESPONSE_COST_METRIC, description="Decode time one streamed response was measured to cost",
                               kind=mf.GAUGE)
        self._families.append(self._cost_family)
        self._response_cost: Any = None
        self._model = model
        self._lock = threading.Lock()  # metric updates are IPC calls into the stub: one at a time
        self._running = 0

    def started(self) -> None:
        with self._lock:
            self._running += 1
            self._active.set(self._running)

    def ended(self, tokens: int, cached_tokens: int | None, cancelled: bool) -> None:
        with self._lock:
            self._running -= 1
            self._active.set(self._running)
            if tokens:
                self._tokens.increment(tokens)
            if cached_tokens is not None:
                self._kv.set(cached_tokens)
            if cancelled:
                self._cancelled.increment(1)

    def streaming(self, pace: Pace) -> None:
        """The pacer's interval and measured cost, from one fit: at start and as each request ends."""
        with self._lock:
            self._interval.set(pace.interval_ms / 1000)
            if pace.cost_ms is None:
                return
            if self._response_cost is None:
                self._response_cost = self._cost_family.Metric(labels={"model": self._model})
            self._response_cost.set(pace.cost_ms / 1000)
