"""cost_model/stream_pacer: the engine measures what a streamed response costs its decode and streams
as finely as its budget allows. Simulated engines with a known response cost, where the fit must
find that cost from decode times alone."""

from __future__ import annotations

import random

import pytest

from specgate.cost_model import stream_pacer
from specgate.cost_model.stream_pacer import MAX_INTERVAL_MS, START_INTERVAL_MS, Pace, StreamPacer, _Decode, fit_response_cost


def stream(pacer: StreamPacer, decodes: int, base_ms: dict[int, float], cost_ms: float, spill: float = 0.4,
           noise_ms: float = 0.3, seed: int = 0, between: float = 0.0) -> list[int]:
    """One streamed request on a simulated engine: decode shapes cycle through `base_ms`' keys, and a
    response costs `cost_ms` of decode time, `spill` of it falling on the next decode and `between`
    of it on the Python before this one. Returns the number of tokens in each response."""
    rng = random.Random(seed)
    shapes = list(base_ms)
    t, last_flush, carry, pending, chunks = 0.0, float("-inf"), 0.0, 0, []
    pacer.opened()
    for i in range(decodes):
        sent = 0
        if pending and pacer.due(last_flush, t):  # the previous token's event
            pacer.sent()
            chunks.append(pending)
            last_flush, pending, sent = t, 0, 1
        shape = shapes[i % len(shapes)]
        ms = base_ms[shape] + rng.gauss(0, noise_ms) + carry + sent * cost_ms * (1 - spill - between)
        carry = sent * cost_ms * spill
        start = t + (0.2 + sent * cost_ms * between) / 1000  # the Python between two decodes
        t = start + ms / 1000
        pacer.decoded(shape, start, t)
        pending += 1
    pacer.closed()
    return chunks


@pytest.mark.parametrize("cost_ms", [1.0, 2.5])
def test_a_dear_response_is_measured_and_the_interval_keeps_it_within_budget(cost_ms: float) -> None:
    """Like a 2-core VM: 10 ms tokens, a response costs a tenth to a quarter of one."""
    pacer = StreamPacer(budget=0.05)
    assert pacer.interval_ms == START_INTERVAL_MS and pacer.cost_ms is None
    stream(pacer, 3000, {1: 10.0}, cost_ms)
    assert pacer.cost_ms == pytest.approx(cost_ms, rel=0.15)
    assert pacer.interval_ms == pytest.approx(cost_ms / 0.05, rel=0.15)


def test_what_a_response_costs_the_python_between_decodes_is_counted() -> None:
    """The served engine's step slows too when a response goes out (its sender thread shares the
    GIL; other processes preempt it): on the Ice Lake VM a tenth of what a response cost fell there."""
    pacer = StreamPacer(budget=0.05)
    stream(pacer, 3000, {1: 10.0}, 2.5, between=0.3)
    assert pacer.cost_ms == pytest.approx(2.5, rel=0.15)


def test_a_cheap_response_streams_every_token_and_probes_keep_the_fit_alive() -> None:
    """A machine with cores to spare: a response costs 0.05 ms against 3 ms tokens. The interval
    falls under a decode, so nearly every token gets its own response; the probes' held decodes
    are what the fit still learns from."""
    pacer = StreamPacer(budget=0.05)
    chunks = stream(pacer, 4000, {1: 3.0}, 0.05, noise_ms=0.1)
    assert pacer.interval_ms < 3.0
    late = chunks[len(chunks) // 2 :]
    assert sum(c == 1 for c in late) / len(late) > 0.85  # per token, but for the probes
    assert max(late) == stream_pacer.PROBE_HOLD + 1
    assert pacer.cost_ms == pytest.approx(0.05, abs=0.05)


def test_streams_open_together_share_the_budget() -> None:
    """The batched baseline streams N requests at once: N responses per interval cost N times one,
    so each stream waits N intervals (within the cap)."""
    pacer = StreamPacer(budget=0.05)
    stream(pacer, 3000, {1: 10.0}, 1.0)
    one = pacer.interval_ms
    assert one == pytest.approx(20.0, rel=0.15)
    for _ in range(3):
        pacer.opened()
    assert not pacer.due(0.0, 2.5 * one / 1000) and pacer.due(0.0, 3.05 * one / 1000)
    for _ in range(5):
        pacer.opened()
    assert pacer.due(0.0, MAX_INTERVAL_MS / 1000 + 1e-6)  # 8 x 20 ms, capped


def test_a_dear_response_is_capped() -> None:
    pacer = StreamPacer(budget=0.05)
    stream(pacer, 3000, {1: 10.0}, 15.0)
    assert pacer.interval_ms == MAX_INTERVAL_MS


def test_shapes_of_different_cost_do_not_pass_for_a_response_cost() -> None:
    """spec_engine: a 9-token verification takes twice a 1-token one. Here responses go out during
    runs of the dear shape (and during no cheap one), so a fit without a cost per shape would charge
    the difference to the responses (9.5 ms a response, not 2)."""
    rng = random.Random(1)
    raw = []
    for i in range(512):
        dear = i % 8 < 4
        sent = int(dear and (i // 8) % 4 != 3)  # one run in four holds its responses: quiet dear decodes
        raw.append((9 if dear else 1, (20.0 if dear else 10.0) + 2.0 * sent + rng.gauss(0, 0.2), sent))
    decodes = [_Decode(shape, ms / 1000, sent, raw[i - 1][2] if i else 0) for i, (shape, ms, sent) in enumerate(raw)]
    assert fit_response_cost(decodes) == pytest.approx(2.0, rel=0.1)


def test_decodes_that_never_go_without_a_response_give_no_fit() -> None:
    """Every decode has a response in its window or the previous one: the cost cannot be told from
    the decode's own time, and the pacer keeps what it had rather than guess."""
    decodes = [_Decode(1, 0.010, i % 2, (i + 1) % 2) for i in range(512)]
    assert fit_response_cost(decodes) is None


def test_decodes_with_no_stream_open_teach_nothing() -> None:
    """spec_engine calibrates, and plain requests decode, with no stream to pay for."""
    pacer = StreamPacer(budget=0.05)
    t = 0.0
    for _ in range(1000):
        pacer.decoded(1, t, t + 0.01)
        t += 0.0102
    assert pacer.cost_ms is None and not pacer._decodes


def test_a_fixed_interval_is_kept_and_nothing_is_measured() -> None:
    pacer = StreamPacer(budget=0.05, fixed_ms=20.0)
    stream(pacer, 1000, {1: 10.0}, 2.5)
    assert pacer.interval_ms == 20.0 and pacer.cost_ms is None
    assert pacer.due(0.0, 0.021) and not pacer.due(0.0, 0.019)


def test_a_budget_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        StreamPacer(budget=1.5)


def test_the_engine_exports_its_interval_at_once_and_a_cost_only_once_measured() -> None:
    """A gauge that was never set reads 0 on the metrics port, which would say "a response is free":
    the cost's series appears with the first measurement."""
    from specgate.contract import ENGINE_RESPONSE_COST_METRIC, ENGINE_STREAM_INTERVAL_METRIC
    from specgate.gate.metrics import InMemoryMetricFactory
    from specgate.serving.engine_metrics import EngineMetrics

    factory = InMemoryMetricFactory()
    metrics = EngineMetrics(factory, "target_engine")
    metrics.streaming(Pace(START_INTERVAL_MS))
    assert factory.families[ENGINE_STREAM_INTERVAL_METRIC].value(model="target_engine") == START_INTERVAL_MS / 1000
    assert not factory.families[ENGINE_RESPONSE_COST_METRIC].metrics
    metrics.streaming(Pace(40.0, 2.0))
    metrics.streaming(Pace(60.0, 3.0))
    assert factory.families[ENGINE_RESPONSE_COST_METRIC].value(model="target_engine") == 0.003
    assert factory.families[ENGINE_STREAM_INTERVAL_METRIC].value(model="target_engine") == 0.06


def test_the_engine_exports_the_interval_and_the_cost_of_one_fit_while_the_pacer_refits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode thread refits while the response sender exports. CI once read an interval of
    24.9 ms beside a cost that gives 31.2 ms: the export read the interval, a refit landed, then it
    read the cost. Here a refit lands right after every read of the pacer."""
    from types import SimpleNamespace

    from tests.unit import fake_pb_utils

    fake_pb_utils.install()
    from specgate.contract import ENGINE_RESPONSE_COST_METRIC, ENGINE_STREAM_INTERVAL_METRIC
    from specgate.gate.metrics import InMemoryMetricFactory
    from specgate.serving.engine_metrics import EngineMetrics
    from specgate.serving.engine_model import EngineModel
    from specgate.serving.live_requests import LiveRequests

    costs = iter([1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    monkeypatch.setattr(stream_pacer, "fit_response_cost", lambda decodes: next(costs))

    class RefitsWhileRead(StreamPacer):
        def __getattribute__(self, name: str):  # noqa: ANN204
            value = super().__getattribute__(name)
            if name in ("pace", "interval_ms", "cost_ms") and not super().__getattribute__("refitting"):
                self.refitting = True
                super().__getattribute__("_refit")()
                self.refitting = False
            return value

    pacer = RefitsWhileRead(budget=0.05)
    pacer.refitting = True
    pacer._decodes.extend(_Decode(1, 0.01, 0, 0) for _ in range(stream_pacer.MIN_DECODES))
    pacer._refit()  # a first fit, so that a cost is exported
    pacer.refitting = False
    factory = InMemoryMetricFactory()
    model = EngineModel.__new__(EngineModel)
    model.live, model.pacer, model.metrics = LiveRequests(), pacer, EngineMetrics(factory, "target_engine")
    model.metrics.started()
    model._ended(SimpleNamespace(tokens=[1, 2], cancelled=False), SimpleNamespace(cached_tokens=0), None)
    interval = factory.families[ENGINE_STREAM_INTERVAL_METRIC].value(model="target_engine")
    cost = factory.families[ENGINE_RESPONSE_COST_METRIC].value(model="target_engine")
    assert interval == pytest.approx(cost / 0.05)
