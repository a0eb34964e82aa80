"""Read the Prometheus text from the server's metrics port."""

from __future__ import annotations

import re

import requests

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(port: int) -> dict[str, float]:
    """{'name{label="v",...}': value} for every sample (labels as exported, sorted)."""
    out: dict[str, float] = {}
    for line in requests.get(f"http://localhost:{port}/metrics", timeout=10).text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = m.group(2) or ""
            if labels:
                labels = "{" + ",".join(sorted(labels[1:-1].split(","))) + "}"
            out[m.group(1) + labels] = float(m.group(3))
    return out


def value(metrics: dict[str, float], name: str, **labels: str) -> float:
    key = name + ("{" + ",".join(sorted(f'{k}="{v}"' for k, v in labels.items())) + "}" if labels else "")
    return metrics.get(key, 0.0)


def delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
