"""loadtest.metrics, the one Prometheus text scraper (load test, report, integration tests), on canned text."""

from __future__ import annotations

from types import SimpleNamespace

from loadtest import metrics

BEFORE = """# HELP spec_gate_decisions_total Gate decisions by route and reason
# TYPE spec_gate_decisions_total counter
spec_gate_decisions_total{route="speculative",reason="prod"} 2
spec_decode_num_draft_tokens_total 10
"""
AFTER = """spec_gate_decisions_total{reason="prod",route="speculative"} 5
spec_gate_decisions_total{route="baseline",reason="temperature"} 1
spec_decode_num_draft_tokens_total 1.5e1
"""


def _scrape(monkeypatch, text: str, url: str | int) -> metrics.Samples:
    seen = []
    monkeypatch.setattr(metrics.requests, "get", lambda u, timeout: seen.append(u) or SimpleNamespace(text=text))
    out = metrics.scrape(url)
    assert seen == ["http://localhost:18002/metrics"]
    return out


def test_value_delta_and_grouping(monkeypatch) -> None:
    before = _scrape(monkeypatch, BEFORE, 18002)
    after = _scrape(monkeypatch, AFTER, "http://localhost:18002/metrics")
    assert len(before) == 2  # comments skipped
    assert metrics.value(after, "spec_gate_decisions_total", route="speculative", reason="prod") == 5  # label order ignored
    assert metrics.value(after, "spec_gate_decisions_total") == 0  # labels must match exactly
    assert metrics.delta(before, after, "spec_gate_decisions_total", route="speculative", reason="prod") == 3
    assert metrics.delta(before, after, "spec_decode_num_draft_tokens_total") == 5
    assert metrics.delta_by(before, after, "spec_gate_decisions_total", "route", "reason") == {
        "baseline,temperature": 1,
        "speculative,prod": 3,
    }


def test_gate_deltas_from_a_fresh_server(monkeypatch) -> None:
    """gpu-smoke reads a fresh server's totals as deltas from nothing."""
    counters = metrics.gate_deltas({}, _scrape(monkeypatch, AFTER, 18002))
    assert counters["decisions"] == {"baseline,temperature": 1, "speculative,prod": 5}
    assert counters["totals"] == {"num_drafts": 0, "num_draft_tokens": 15, "num_accepted_tokens": 0}
