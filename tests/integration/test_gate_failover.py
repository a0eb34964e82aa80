"""Issue 4: when spec_engine fails or goes away mid-run, no client request is lost.

Kept in its own module (runs after test_gate.py) because it unloads and reloads spec_engine.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from loadtest.metrics import delta, scrape
from specgate.client import GenerateParams, collect
from tests.integration.stubs import stub_pids

PROMPTS = [
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog by the river.",
    "Rewrite this sentence in all capital letters: the weather today is sunny and warm with a light breeze.",
    "Explain recursion to a ten-year-old.",
    "Write a short limerick about a programmer.",
]
PARAMS = GenerateParams(max_tokens=48, num_speculative_tokens=4)
KEY = "tenant-failover"


def _repo(http, action: str, model: str = "spec_engine") -> None:
    r = requests.post(f"{http.base}/v2/repository/models/{model}/{action}", timeout=300)
    assert r.status_code == 200, r.text


def _run_concurrently(http, grpc, during) -> list[tuple[str, str, str]]:
    """Stream every prompt speculatively (HTTP and gRPC alternately) and call `during` mid-run."""

    def one(i: int) -> tuple[str, str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        stream = http.stream(p, PARAMS, api_key=KEY) if i % 2 else grpc.stream(p, PARAMS, api_key=KEY)
        r = collect(stream)
        return p, r.text, r.meta["gate_reason"]

    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(one, i) for i in range(8)]
        time.sleep(2.0)
        during()
        return [f.result(timeout=600) for f in futures]


def test_spec_engine_killed_or_unloaded_loses_no_request(http, grpc, server):
    expected = {p: http.generate(p, PARAMS, spec_mode="off").text for p in PROMPTS}
    before = scrape(server.metrics)
    try:
        # 1. kill the engine's process mid-stream: requests continue on the baseline
        def kill() -> None:
            pids = stub_pids("spec_engine")
            assert pids, "spec_engine stub process not found"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

        for p, text, reason in _run_concurrently(http, grpc, kill):
            assert text == expected[p], f"{reason}: output differs for {p!r}"
        # 2. unload it mid-run: same guarantee
        _repo(http, "load")  # a fresh instance after the kill
        for p, text, reason in _run_concurrently(http, grpc, lambda: _repo(http, "unload")):
            assert text == expected[p], f"{reason}: output differs for {p!r}"
        # while it is gone, speculative requests are served by the baseline
        r = http.generate(PROMPTS[0], PARAMS, api_key=KEY)
        assert r.text == expected[PROMPTS[0]] and r.meta["route"] == "baseline"
        after = scrape(server.metrics)
        assert delta(before, after, "spec_gate_engine_failures_total", engine="speculative") >= 1
    finally:
        _repo(http, "load")
