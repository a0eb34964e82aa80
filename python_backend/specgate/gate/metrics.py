"""The gate's Prometheus metrics, exported through Triton's `pb_utils.MetricFamily`.

The metric-family factory is injected: the adapter passes `triton_python_backend_utils` itself, tests
and bench/gate_decision.py pass `InMemoryMetricFactory` (below), which has the same shape
(`factory.MetricFamily(name=, description=, kind=)`, the kinds as
`MetricFamily.COUNTER|GAUGE|HISTOGRAM`, `family.Metric(labels=..., buckets=...)`, and
`.increment(v)` / `.set(v)` / `.observe(v)`). Metric objects are cached per label set.

Formulas (as vLLM and TensorRT-LLM compute them), over any window `[5m]`:

    acceptance rate            = rate(spec_decode_num_accepted_tokens_total)
                                 / rate(spec_decode_num_draft_tokens_total)
    mean acceptance length     = 1 + rate(spec_decode_num_accepted_tokens_total)
                                     / rate(spec_decode_num_drafts_total)
    acceptance at position i   = rate(spec_decode_num_accepted_tokens_per_pos_total{position="i"})
                                 / rate(spec_decode_num_drafts_total)
    spec_decode_acceptance_rate{tenant}  the breaker's rolling per-request EMA (a gauge)
    spec_gate_circuit_open{tenant}       0 closed, 0.5 half-open, 1 open

Tenant labels are 8 hex of an HMAC under the server's secret (labels.py), never the raw key.

Every series without labels, and every label set known at load (decisions by route and reason,
engines, tenants of the key file, draft positions up to the policy's maximum) is created at 0 when
the gate loads, so /metrics shows 0 rather than nothing before the first event. The exception is
spec_decode_acceptance_rate{tenant}: before a tenant's first sample its EMA is unknown, not 0, and a
0 would read as "nothing accepted".
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from specgate.gate.decision import Route

# 5 us .. 10 ms: a decision is expected in tens of microseconds; the tail shows policy reloads.
DECISION_LATENCY_BUCKETS: list[float] = [
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2,
]

NUM_DRAFTS = "spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "spec_decode_num_accepted_tokens_total"
NUM_ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
ACCEPTANCE_RATE = "spec_decode_acceptance_rate"
DECISIONS = "spec_gate_decisions_total"
CIRCUIT_OPEN = "spec_gate_circuit_open"
SHADOW_MISMATCH = "spec_gate_shadow_mismatch_total"
SHADOW_COMPARISONS = "spec_gate_shadow_comparisons_total"
DECISION_LATENCY = "spec_gate_decision_latency_seconds"
ENGINE_FAILURES = "spec_gate_engine_failures_total"
IN_FLIGHT = "spec_gate_in_flight"
OVERRIDE_IGNORED = "spec_gate_override_ignored_total"
OVERLOADED = "spec_gate_overloaded_total"
QUEUED = "spec_gate_queued"
CANCELLED = "spec_gate_cancelled_total"
SHADOW_IN_FLIGHT = "spec_gate_shadow_in_flight"

_Labels = tuple[tuple[str, str], ...]


QUEUE_FULL, QUEUE_TIMEOUT = "queue_full", "queue_timeout"  # the `reason` label of spec_gate_overloaded_total


class GateMetrics:
    def __init__(self, factory: Any | None, decisions: Iterable[tuple[str, str]] = ()) -> None:
        """`factory`: `triton_python_backend_utils` (or a fake); None exports nothing.
        `decisions`: the (reason, route) pairs the gate can decide, created at 0."""
        mf = (factory if factory is not None else _NULL_FACTORY).MetricFamily
        counter, gauge, histogram = mf.COUNTER, mf.GAUGE, mf.HISTOGRAM
        specs = {
            NUM_DRAFTS: ("Speculative drafts proposed (verification steps)", counter),
            NUM_DRAFT_TOKENS: ("Draft tokens proposed", counter),
            NUM_ACCEPTED_TOKENS: ("Draft tokens accepted by the target", counter),
            NUM_ACCEPTED_PER_POS: ("Draft tokens accepted, by draft position (0-based)", counter),
            ACCEPTANCE_RATE: ("Rolling per-request acceptance EMA per tenant", gauge),
            DECISIONS: ("Gate decisions by route and reason", counter),
            CIRCUIT_OPEN: ("Breaker state per tenant: 0 closed, 0.5 half-open, 1 open", gauge),
            SHADOW_MISMATCH: ("Shadow mirrors whose output differed from the baseline", counter),
            SHADOW_COMPARISONS: ("Shadow mirrors compared with the baseline", counter),
            DECISION_LATENCY: ("Time to take one gate decision, seconds", histogram),
            ENGINE_FAILURES: ("Engine calls that failed, by engine", counter),
            IN_FLIGHT: ("Requests in flight through the gate", gauge),
            OVERRIDE_IGNORED: ("Requests whose own mode choice was ignored: the tenant may not override", counter),
            OVERLOADED: ("Requests refused as overloaded: queue full, or no slot before the queue timeout", counter),
            QUEUED: ("Requests waiting in the gate's admission queue", gauge),
            CANCELLED: ("Requests whose client cancelled them mid-stream; their engines were told to stop", counter),
            SHADOW_IN_FLIGHT: ("Shadow mirrors holding a mirror slot (started and not yet recorded)", gauge),
        }
        self._families = {
            name: mf(name=name, description=desc, kind=kind) for name, (desc, kind) in specs.items()
        }
        self._metrics: dict[tuple[str, _Labels], Any] = {}
        # Every metric update is an IPC call into the Python backend stub, made from the gate's
        # worker threads; they are serialized (a stub crashed with heap corruption without this).
        self._lock = threading.RLock()
        with self._lock:
            for name in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, SHADOW_MISMATCH, SHADOW_COMPARISONS,
                         IN_FLIGHT, QUEUED, CANCELLED, SHADOW_IN_FLIGHT):
                self._get(name)
            self._get(DECISION_LATENCY, (), DECISION_LATENCY_BUCKETS)
            for engine in Route:  # the `engine` label of spec_gate_engine_failures_total
                self._get(ENGINE_FAILURES, (("engine", engine),))
            for reason in (QUEUE_FULL, QUEUE_TIMEOUT):
                self._get(OVERLOADED, (("reason", reason),))
            for reason, route in decisions:
                self._get(DECISIONS, (("route", route), ("reason", reason)))

    def declare_tenant(self, tenant: str) -> None:
        """A tenant's series at their initial values: breaker closed, nothing ignored."""
        with self._lock:
            self._get(CIRCUIT_OPEN, (("tenant", tenant),))
            self._get(OVERRIDE_IGNORED, (("tenant", tenant),))

    def declare_positions(self, n: int) -> None:
        with self._lock:
            for pos in range(n):
                self._get(NUM_ACCEPTED_PER_POS, (("position", str(pos)),))

    def _get(self, name: str, labels: _Labels = (), buckets: list[float] | None = None) -> Any:
        """The Metric for one label set, created once; callers hold `self._lock`."""
        key = (name, labels)
        metric = self._metrics.get(key)
        if metric is None:
            kwargs: dict[str, Any] = {"labels": dict(labels)}
            if buckets is not None:
                kwargs["buckets"] = buckets
            metric = self._families[name].Metric(**kwargs)
            self._metrics[key] = metric
        return metric

    def decision(self, route: Route, reason: str, latency_s: float) -> None:
        with self._lock:
            self._get(DECISIONS, (("route", route), ("reason", reason))).increment(1)
            self._get(DECISION_LATENCY, (), DECISION_LATENCY_BUCKETS).observe(latency_s)

    def speculative_stats(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        accepted_per_position: Sequence[int],
    ) -> None:
        with self._lock:
            self._get(NUM_DRAFTS).increment(num_drafts)
            self._get(NUM_DRAFT_TOKENS).increment(num_draft_tokens)
            self._get(NUM_ACCEPTED_TOKENS).increment(num_accepted_tokens)
            for pos, n in enumerate(accepted_per_position):
                if n:
                    self._get(NUM_ACCEPTED_PER_POS, (("position", str(pos)),)).increment(n)

    def acceptance_rate(self, tenant: str, ema: float) -> None:
        with self._lock:
            self._get(ACCEPTANCE_RATE, (("tenant", tenant),)).set(ema)

    def circuit_state(self, tenant: str, value: float) -> None:
        with self._lock:
            self._get(CIRCUIT_OPEN, (("tenant", tenant),)).set(value)

    def shadow_compared(self, mismatch: bool) -> None:
        with self._lock:
            self._get(SHADOW_COMPARISONS).increment(1)
            if mismatch:
                self._get(SHADOW_MISMATCH).increment(1)

    def engine_failure(self, engine: Route) -> None:
        with self._lock:
            self._get(ENGINE_FAILURES, (("engine", engine),)).increment(1)

    def override_ignored(self, tenant: str) -> None:
        with self._lock:
            self._get(OVERRIDE_IGNORED, (("tenant", tenant),)).increment(1)

    def overloaded(self, reason: str) -> None:
        with self._lock:
            self._get(OVERLOADED, (("reason", reason),)).increment(1)

    def cancelled(self) -> None:
        with self._lock:
            self._get(CANCELLED).increment(1)

    def queued(self, n: int) -> None:
        with self._lock:
            self._get(QUEUED).set(n)

    def in_flight(self, n: int) -> None:
        with self._lock:
            self._get(IN_FLIGHT).set(n)

    def mirrors(self, n: int) -> None:
        with self._lock:
            self._get(SHADOW_IN_FLIGHT).set(n)


class _NullMetric:
    def increment(self, value: float) -> None: ...
    def set(self, value: float) -> None: ...
    def observe(self, value: float) -> None: ...


class _NullFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None: ...

    def Metric(  # noqa: N802 (pb_utils' name)
        self, labels: dict[str, str], buckets: list[float] | None = None
    ) -> _NullMetric:
        return _NullMetric()


_NULL_FACTORY = SimpleNamespace(MetricFamily=_NullFamily)


class InMemoryMetric:
    """One exported series: `value` for counters and gauges, every observation for histograms."""

    def __init__(self, kind: str, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.kind, self.labels, self.buckets = kind, labels, buckets
        self.value = 0.0
        self.observations: list[float] = []

    def increment(self, value: float) -> None:
        assert self.kind == "counter" and value >= 0
        self.value += value

    def set(self, value: float) -> None:
        assert self.kind == "gauge"
        self.value = value

    def observe(self, value: float) -> None:
        assert self.kind == "histogram"
        self.observations.append(value)


class InMemoryFamily:
    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.metrics: list[InMemoryMetric] = []

    def Metric(  # noqa: N802 (pb_utils' name)
        self, labels: dict[str, str], buckets: list[float] | None = None
    ) -> InMemoryMetric:
        assert isinstance(labels, dict)
        assert (buckets is not None) == (self.kind == "histogram"), "buckets only (and always) for histograms"
        metric = InMemoryMetric(self.kind, labels, buckets)
        self.metrics.append(metric)
        return metric

    def value(self, **labels: str) -> float:
        """The value of the series with exactly these labels; 0 when it was never created."""
        found = [m for m in self.metrics if m.labels == labels]
        assert len(found) <= 1, "a label set must map to one cached Metric"
        return found[0].value if found else 0.0


class _InMemoryFamilyConstructor:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, families: dict[str, InMemoryFamily]) -> None:
        self._families = families

    def __call__(self, name: str, description: str, kind: str) -> InMemoryFamily:
        assert name not in self._families, f"family {name} registered twice"
        family = self._families[name] = InMemoryFamily(name, kind)
        return family


class InMemoryMetricFactory:
    """A pb_utils-shaped factory that keeps every metric in memory, checking pb_utils' rules as it
    goes (kinds, buckets only for histograms, one family per name). `families` maps name -> family.

    For tests and bench/gate_decision.py (which times decisions with their metric updates included);
    the serving path passes the real `triton_python_backend_utils`.
    """

    def __init__(self) -> None:
        self.families: dict[str, InMemoryFamily] = {}
        self.MetricFamily = _InMemoryFamilyConstructor(self.families)  # noqa: N815 (pb_utils' name)
