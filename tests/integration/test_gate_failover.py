"""Issue 4: when spec_engine fails or goes away mid-run, no client request is lost. And the
model-repository API that unloads it answers only with the admin key.

Kept in its own module (runs after test_gate.py) because it unloads and reloads spec_engine.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from loadtest.metrics import delta, scrape
from specgate.client import GenerateParams, collect
from specgate.launcher import admin_headers
from tests.conftest import stub_pids

PROMPTS = [
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog by the river.",
    "Rewrite this sentence in all capital letters: the weather today is sunny and warm with a light breeze.",
    "Explain recursion to a ten-year-old.",
    "Write a short limerick about a programmer.",
]
PARAMS = GenerateParams(max_tokens=48, num_speculative_tokens=4)
KEY = "tenant-failover"


def _repo(http, action: str, model: str = "spec_engine") -> None:
    r = requests.post(f"{http.base}/v2/repository/models/{model}/{action}", headers=admin_headers(), timeout=300)
    assert r.status_code == 200, r.text


def _ready(http, model: str = "spec_engine") -> bool:
    return requests.get(f"{http.base}/v2/models/{model}/ready", timeout=30).status_code == 200


def test_control_apis_refuse_callers_without_the_admin_key(http, grpc, server):
    g = grpcclient.InferenceServerClient(f"localhost:{server.grpc}")
    unload = f"{http.base}/v2/repository/models/spec_engine/unload"
    r = requests.post(unload, timeout=60)
    print(f"\nunload without the key: HTTP {r.status_code} {r.text}")
    assert r.status_code == 403 and "restricted" in r.text.lower()
    with pytest.raises(InferenceServerException) as err:
        g.unload_model("spec_engine")
    print(f"gRPC: {err.value.status()} {err.value.message()}")
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "restricted" in err.value.message().lower()
    assert requests.post(unload, headers={"specgate-admin-key": "wrong"}, timeout=60).status_code == 403
    for other in ("/v2/logging", "/v2/trace/setting"):  # the other restricted APIs
        assert requests.get(f"{http.base}{other}", timeout=60).status_code == 403, other
        assert requests.get(f"{http.base}{other}", headers=admin_headers(), timeout=60).status_code == 200, other
    assert _ready(http) and http.generate(PROMPTS[0], PARAMS).text  # nothing happened; inference is open

    _repo(http, "unload")  # with the key it works
    deadline = time.time() + 120
    while _ready(http) and time.time() < deadline:
        time.sleep(1)
    assert not _ready(http)
    g.load_model("spec_engine", headers=admin_headers(grpc=True))  # gRPC with the key too
    assert _ready(http)


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
