"""Micro-benchmark: latency of one `Gate.decide()` in-process (target p99 < 100 us).

    .venv/bin/python -m bench.gate_decision [--n 100000] [--policy policy/default.yaml]

A mixed workload (tenants, unknown keys, temperatures, canary and shadow requests, the policy-file
mtime check) with metrics going to `InMemoryMetricFactory` (shaped like pb_utils), so the cost of
recording the decision is included. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

from specgate.gate import Gate, RequestInputs
from specgate.gate.metrics import InMemoryMetricFactory
from specgate.gate.tenants import hash_key

REPO = Path(__file__).resolve().parents[1]
TENANTS = {f"tenant-key-{i}": ("prod", "shadow", "off")[i % 3] for i in range(20)}


def _policy_file(base: Path, directory: Path) -> Path:
    (directory / "tenants.yaml").write_text("".join(f"team-{i}: [{hash_key(k)}]\n" for i, k in enumerate(TENANTS)))
    tenants = "".join(f"  team-{i}: {{mode: {m}}}\n" for i, m in enumerate(TENANTS.values()))
    text = base.read_text().replace("tenants: {}", "tenants:\n" + tenants).replace("key_file: null", "key_file: tenants.yaml")
    path = directory / "policy.yaml"
    path.write_text(text)
    return path


def _workload(n: int, seed: int) -> list[RequestInputs]:
    rng = random.Random(seed)
    keys = [*TENANTS, None, "unknown-key"]
    return [
        RequestInputs(
            request_id=f"req-{i}",
            api_key=rng.choice(keys),
            spec_header=rng.choice([None, None, None, "prod", "shadow", "off"]),
            temperature=rng.choice([0.0, 0.2, 0.7, 1.0]),
        )
        for i in range(n)
    ]


def measure(n: int, policy: Path) -> dict:
    """Time `n` decisions (after a warm-up); returns p50/p99/max in microseconds and reason counts."""
    with tempfile.TemporaryDirectory() as tmp:
        gate = Gate(str(_policy_file(policy, Path(tmp))), metric_factory=InMemoryMetricFactory())
        requests = _workload(n, seed=0)
        warmup = 2000  # fills the label and metric caches; not measured
        samples: list[int] = []
        reasons: dict[str, int] = {}
        perf = time.perf_counter_ns
        gc.disable()
        try:
            for i, r in enumerate(requests[:warmup] + requests):
                t0 = perf()
                d = gate.decide(r)
                t1 = perf()
                if i >= warmup:
                    samples.append(t1 - t0)
                    reasons[d.reason] = reasons.get(d.reason, 0) + 1
                if d.shadow:
                    gate.end_shadow(d, mismatch=False)
                gate.finish(d)
        finally:
            gc.enable()
    q = statistics.quantiles(samples, n=100)
    return {"n": len(samples), "p50_us": q[49] / 1e3, "p99_us": q[98] / 1e3, "max_us": max(samples) / 1e3, "reasons": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--policy", type=Path, default=REPO / "policy" / "default.yaml")
    args = ap.parse_args()
    r = measure(args.n, args.policy)
    print(f"decisions: {r['n']}")
    print(f"p50: {r['p50_us']:.1f} us   p99: {r['p99_us']:.1f} us   max: {r['max_us']:.1f} us")
    print("reasons:", ", ".join(f"{k}={v}" for k, v in sorted(r["reasons"].items())))


if __name__ == "__main__":
    main()
