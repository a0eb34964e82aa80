"""Metrics through the in-memory pb_utils-shaped factory: families, labels, exact counts, per-label-set caching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgate.gate import REASONS, Gate, RequestInputs, Route
from specgate.gate.labels import TenantLabels
from specgate.gate.metrics import DECISION_LATENCY_BUCKETS, GateMetrics, InMemoryFamily, InMemoryMetricFactory
from specgate.gate.tenants import hash_key
from specgate.stats import SpecStats


@pytest.fixture
def pb() -> InMemoryMetricFactory:
    return InMemoryMetricFactory()


@pytest.fixture
def fams(pb: InMemoryMetricFactory) -> dict[str, InMemoryFamily]:
    return pb.families


def test_families_and_kinds(pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    GateMetrics(pb)
    kinds = {n: f.kind for n, f in fams.items()}
    assert kinds == {
        "spec_decode_num_drafts_total": "counter",
        "spec_decode_num_draft_tokens_total": "counter",
        "spec_decode_num_accepted_tokens_total": "counter",
        "spec_decode_num_accepted_tokens_per_pos_total": "counter",
        "spec_decode_acceptance_rate": "gauge",
        "spec_gate_decisions_total": "counter",
        "spec_gate_circuit_open": "gauge",
        "spec_gate_shadow_mismatch_total": "counter",
        "spec_gate_shadow_comparisons_total": "counter",
        "spec_gate_decision_latency_seconds": "histogram",
        "spec_gate_engine_failures_total": "counter",
        "spec_gate_in_flight": "gauge",
        "spec_gate_override_ignored_total": "counter",
        "spec_gate_overloaded_total": "counter",
        "spec_gate_queued": "gauge",
        "spec_gate_cancelled_total": "counter",
        "spec_gate_shadow_in_flight": "gauge",
    }


def test_speculative_stats_exact_counts(pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    m = GateMetrics(pb)
    m.speculative_stats(5, 20, 12, [5, 4, 2, 1])
    m.speculative_stats(3, 12, 3, [2, 1, 0, 0])
    assert fams["spec_decode_num_drafts_total"].value() == 8
    assert fams["spec_decode_num_draft_tokens_total"].value() == 32
    assert fams["spec_decode_num_accepted_tokens_total"].value() == 15
    per_pos = fams["spec_decode_num_accepted_tokens_per_pos_total"]
    assert [per_pos.value(position=str(i)) for i in range(4)] == [7, 5, 2, 1]
    assert len(per_pos.metrics) == 4  # cached per label set, not one Metric per call


def test_gate_records_decisions_latency_and_outcomes(tmp_path: Path, pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    path = tmp_path / "p.yaml"
    (tmp_path / "keys.yaml").write_text(f"team: [{hash_key('secret-key')}]\n")
    path.write_text("mode: prod\nkey_file: keys.yaml\nallow_override: true\nbreaker: {failure_threshold: 2}\nload: {max_in_flight: null}\n"
                    "speculative: {num_speculative_tokens: 4}\n")
    gate = Gate(str(path), metric_factory=pb, label_secret=b"s")
    label = TenantLabels(b"s")("team")

    decisions = [gate.decide(RequestInputs(api_key="secret-key", temperature=t)) for t in (0.1, 0.2, 0.9)]
    for d in decisions:
        gate.finish(d)
    shadow = gate.decide(RequestInputs(spec_header="shadow"))
    gate.end_shadow(shadow, mismatch=True)
    gate.finish(shadow)

    dec = fams["spec_gate_decisions_total"]
    assert dec.value(route="speculative", reason="prod") == 2
    assert dec.value(route="baseline", reason="temperature") == 1
    assert dec.value(route="baseline", reason="shadow") == 1
    (latency,) = fams["spec_gate_decision_latency_seconds"].metrics
    assert latency.buckets == DECISION_LATENCY_BUCKETS and len(latency.observations) == 4
    assert all(0 < s < 0.1 for s in latency.observations)
    assert fams["spec_gate_shadow_mismatch_total"].value() == 1
    assert fams["spec_gate_shadow_comparisons_total"].value() == 1
    assert fams["spec_gate_in_flight"].value() == 0

    gate.record_speculative(decisions[0], SpecStats(draft_tokens=8, accepted_tokens=6,
                                                    num_drafts=2, accepted_per_position=[2, 2, 1, 1]))
    gate.record_speculative(decisions[1], SpecStats(draft_tokens=9, accepted_tokens=2))
    assert fams["spec_decode_num_drafts_total"].value() == 2 + 3  # 9 tokens / k=4 -> 3 drafts
    assert fams["spec_decode_num_draft_tokens_total"].value() == 17
    assert fams["spec_decode_acceptance_rate"].value(tenant=label) == pytest.approx((0.75 + 2 / 9) / 2)  # the mean of the first 1/w

    assert fams["spec_gate_cancelled_total"].value() == 0  # at 0 from the start
    gate.record_cancelled()
    assert fams["spec_gate_cancelled_total"].value() == 1

    gate.record_failure(decisions[0], Route.SPECULATIVE)
    gate.record_failure(decisions[0], Route.SPECULATIVE)
    gate.record_failure(decisions[0], Route.BASELINE)
    assert fams["spec_gate_engine_failures_total"].value(engine="speculative") == 2
    assert fams["spec_gate_engine_failures_total"].value(engine="baseline") == 1
    assert fams["spec_gate_circuit_open"].value(tenant=label) == 1.0

    all_labels = [m.labels for f in fams.values() for m in f.metrics]
    assert not any("secret-key" in v for labels in all_labels for v in labels.values())


def test_no_factory_exports_nothing_and_works() -> None:
    gate = Gate(None)
    d = gate.decide(RequestInputs(use_speculative_decoding=True))
    gate.record_speculative(d, SpecStats(draft_tokens=4, accepted_tokens=4))
    gate.finish(d)
    assert (d.route, d.reason) == ("baseline", "mode_off")  # built-in policy: off, overrides not allowed


def test_dashboard_plots_every_gate_metric_and_triton_ones(pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    GateMetrics(pb)
    dash = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "specgate.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for name in fams:
        assert name in exprs, f"{name} not on the dashboard"
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_queue_duration_us"):
        assert name in exprs
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource"}


def test_drafts_estimated_when_the_engine_reports_none(pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    gate = Gate(None, metric_factory=pb)
    d = gate.decide(RequestInputs(use_speculative_decoding=True, num_speculative_tokens=3))
    gate.record_speculative(d, SpecStats(draft_tokens=7, accepted_tokens=5, num_drafts=0))
    gate.record_speculative(d, SpecStats(draft_tokens=0, accepted_tokens=0, num_drafts=0))
    gate.finish(d)
    assert fams["spec_decode_num_drafts_total"].value() == 3  # ceil(7 / 3); nothing drafted: 0


def test_every_series_known_at_load_exists_at_zero(tmp_path: Path, pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    """A dashboard shows 0, not "no data", and a rate() alert can start before the first event."""
    (tmp_path / "keys.yaml").write_text(f"team: [{hash_key('k')}]\n")
    path = tmp_path / "p.yaml"
    path.write_text("key_file: keys.yaml\nspeculative: {max_num_speculative_tokens: 5}\n")
    clock = [0.0]
    gate = Gate(str(path), metric_factory=pb, label_secret=b"s", now=lambda: clock[0])

    def series(name: str) -> list[dict[str, str]]:
        assert all(m.value == 0 and not m.observations for m in fams[name].metrics), name
        return [m.labels for m in fams[name].metrics]

    for name in fams.keys() - {"spec_decode_acceptance_rate"}:  # unknown before a sample, not 0
        assert series(name), f"{name} has no series at load"
    assert series("spec_decode_acceptance_rate") == []
    tenants = [{"tenant": "org"}, {"tenant": TenantLabels(b"s")("team")}]
    assert series("spec_gate_circuit_open") == series("spec_gate_override_ignored_total") == tenants
    assert len(series("spec_gate_decisions_total")) == len(REASONS)
    assert {"route": "speculative", "reason": "prod"} in series("spec_gate_decisions_total")
    assert series("spec_gate_engine_failures_total") == [{"engine": "speculative"}, {"engine": "baseline"}]
    assert series("spec_decode_num_accepted_tokens_per_pos_total") == [{"position": str(i)} for i in range(5)]

    # a tenant added to the key file later gets its series at the first decision after the reload
    (tmp_path / "keys.yaml").write_text(f"team: [{hash_key('k')}]\nnewcomer: [{hash_key('n')}]\n")
    clock[0] = 5.0
    gate.finish(gate.decide(RequestInputs()))
    assert {"tenant": TenantLabels(b"s")("newcomer")} in [m.labels for m in fams["spec_gate_circuit_open"].metrics]


def test_open_mirrors_are_a_gauge(tmp_path: Path, pb: InMemoryMetricFactory, fams: dict[str, InMemoryFamily]) -> None:
    """spec_gate_shadow_in_flight: what `make soak` checks is back at 0 (issue 26: slots leaked)."""
    (tmp_path / "p.yaml").write_text("mode: shadow\nshadow: {max_concurrent_mirrors: 2}\n")
    gate = Gate(str(tmp_path / "p.yaml"), metric_factory=pb)
    d = gate.decide(RequestInputs(temperature=0.0))
    assert d.shadow and fams["spec_gate_shadow_in_flight"].value() == 1
    gate.end_shadow(d, None)
    gate.finish(d)
    assert fams["spec_gate_shadow_in_flight"].value() == 0
