"""The one scraper of the server's Prometheus text: samples, deltas over a run, grouped by label.

Used by the load test, bench/report.py and the integration tests. Hand-written because
prometheus_client is not a dependency and Triton writes the plain one-sample-per-line format.
"""

from __future__ import annotations

import re
from collections import defaultdict

import requests

# name, optional {labels}, value: Triton's metrics port writes one sample per line
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str | int) -> Samples:
    """{(name, frozenset of (label, value)): value} for every sample; `url` may be a localhost metrics port."""
    if isinstance(url, int):
        url = f"http://localhost:{url}/metrics"
    out: Samples = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if m := _SAMPLE.match(line):
            out[(m.group(1), frozenset(_LABEL.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample of `name` with exactly these labels; 0 when absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def value_or_none(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample of `name` with exactly these labels; None when absent (a series that appears only
    once it has something to say, where 0 would be a reading)."""
    return samples.get((name, frozenset(labels.items())))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def delta_by(before: Samples, after: Samples, name: str, *labels: str) -> dict[str, float]:
    """{"v1,v2": after - before} for samples of `name`, keyed by the values of `labels`; zeros dropped."""
    out: dict[str, float] = defaultdict(float)
    for (n, lbls), v in after.items():
        if n == name:
            d = dict(lbls)
            out[",".join(d.get(k, "") for k in labels)] += v - before.get((n, lbls), 0.0)
    return {k: v for k, v in sorted(out.items()) if v}


def gate_deltas(before: Samples, after: Samples) -> dict[str, dict[str, float]]:
    """The counters the reports use: decisions by route and reason, draft/accept totals, per position."""
    return {
        "decisions": delta_by(before, after, "spec_gate_decisions_total", "route", "reason"),
        "totals": {
            n: sum(delta_by(before, after, f"spec_decode_{n}_total").values())
            for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        },
        "accepted_per_position": delta_by(before, after, "spec_decode_num_accepted_tokens_per_pos_total", "position"),
        "engine_failures": delta_by(before, after, "spec_gate_engine_failures_total", "engine"),
    }
