"""Issues 4, 16 and 49: engine faults under load. When spec_engine is killed or unloaded mid-run, no
client request is lost (each finishes on the baseline), the gate counts the failures, and once it is
back speculative traffic resumes. When target_engine is killed, no request is lost either (each
finishes on spec_engine); with both gone, clients get a clear error within seconds, never a hang.
And the model-repository API that unloads and loads models answers only with the admin key.

Kept in its own module (runs after test_gate.py) because it restarts engines: `unload`, then
`load` (on Triton 2.51 a `load` of a loaded model whose files did not change sometimes does nothing,
also when its stub process is dead).
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from loadtest.metrics import delta, scrape, value
from specgate.contract import ENGINE_ACTIVE_METRIC
from specgate_client import GenerateParams, GrpcClient, HttpClient, collect
from specgate_launcher import admin_headers, wait_calibrated
from tests.conftest import COMPUTE_LOCK, TEST_OUT, TEST_POLICY, stub_pids

PROMPTS = [
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog by the river.",
    "Rewrite this sentence in all capital letters: the weather today is sunny and warm with a light breeze.",
    "Explain recursion to a ten-year-old.",
    "Write a short limerick about a programmer.",
]
PARAMS = GenerateParams(max_tokens=48, num_speculative_tokens=4)
KEY = "tenant-failover"
# Asked for by the request, so the gate sends it to spec_engine whatever the calibration expects it
# to buy on this machine (router.py: `no_gain` judges only policy's prod); failures still count
# against the tenant's breaker.


def _repo(http, action: str, model: str = "spec_engine") -> None:
    r = requests.post(f"{http.base}/v2/repository/models/{model}/{action}", headers=admin_headers(), timeout=300)
    assert r.status_code == 200, r.text


def _ready(http, model: str = "spec_engine") -> bool:
    return requests.get(f"{http.base}/v2/models/{model}/ready", timeout=30).status_code == 200


def _restart(http, model: str) -> None:
    """What brings back an engine whose process died (see the module doc). A restarted spec_engine
    measures the machine first, and the gate sends nothing to it before (`calibrating`): wait for it."""
    _repo(http, "unload", model)
    _repo(http, "load", model)
    assert stub_pids(model), f"{model} has no stub process after unload + load"
    if model == "spec_engine":
        wait_calibrated(TEST_OUT / "model_repository")


def _kill(model: str) -> None:
    pids = stub_pids(model)
    assert pids, f"{model} stub process not found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _kill_between_decodes(model: str) -> None:
    """SIGKILL `model`'s stub with its requests in flight, while their decodes wait on the compute lock.

    Not at a random instant: a stub killed inside the Python backend's own shared-memory IPC (a
    response on its way to tritonserver) can abort tritonserver itself, which is Triton 2.51's fault,
    not the gate's (docs/robustness.md, "Limits"; `make serve` restarts such a server). With every
    decode held, the stub has nothing left to send after a moment, and the kill tests what this file
    is about: the gate's handling of an engine that dies mid-request."""
    with open(COMPUTE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            time.sleep(0.5)  # the tokens decoded before the lock leave the stub
            _kill(model)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_held(metrics_port: int, model: str, n: int, futures: list) -> None:  # noqa: ANN001
    """Until `model` holds `n` requests (ENGINE_ACTIVE_METRIC), none of them answered."""
    deadline = time.monotonic() + 30
    while value(scrape(metrics_port), ENGINE_ACTIVE_METRIC, model=model) < n:
        assert time.monotonic() < deadline, f"{model} did not receive {n} requests within 30 s"
        time.sleep(0.05)
    assert not any(f.done() for f in futures), "answered while no engine could decode"


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
    wait_calibrated(TEST_OUT / "model_repository")  # the later tests route to it


def _run_concurrently(http, grpc, during) -> list[tuple[str, str, str]]:
    """Stream every prompt speculatively (HTTP and gRPC alternately) and call `during` once tokens
    flow: not after a fixed wait, which a fast machine spends finishing every request (8 x 48 tokens
    took under 2 s on an AMX Xeon)."""
    streaming = threading.Event()

    def one(i: int) -> tuple[str, str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        stream = http.stream(p, PARAMS, api_key=KEY, spec_mode="prod") if i % 2 else grpc.stream(p, PARAMS, api_key=KEY, spec_mode="prod")

        def noted():  # noqa: ANN202
            for chunk in stream:
                streaming.set()
                yield chunk

        r = collect(noted())
        return p, r.text, r.meta["gate_reason"]

    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(one, i) for i in range(8)]
        assert streaming.wait(120), "no request streamed a token within 120 s"
        during()
        return [f.result(timeout=600) for f in futures]


def test_spec_engine_killed_or_unloaded_loses_no_request(http, grpc, server):
    expected = {p: http.generate(p, PARAMS, spec_mode="off").text for p in PROMPTS}
    before = scrape(server.metrics)
    served: list[tuple[str, str, str]] = []
    try:
        # 1. kill the engine's process mid-stream: requests continue on the baseline
        served += _run_concurrently(http, grpc, lambda: _kill_between_decodes("spec_engine"))
        # 2. unload it mid-run: same guarantee
        _restart(http, "spec_engine")  # a fresh instance after the kill, serving again
        served += _run_concurrently(http, grpc, lambda: _repo(http, "unload"))
        # while it is gone, speculative requests are served by the baseline
        r = http.generate(PROMPTS[0], PARAMS, api_key=KEY, spec_mode="prod")
        assert r.text == expected[PROMPTS[0]] and r.meta["route"] == "baseline"
        served.append((PROMPTS[0], r.text, r.meta["gate_reason"]))
    finally:
        _repo(http, "load")
    for p, text, reason in served:
        assert text == expected[p], f"{reason}: output differs for {p!r}"
    failures = delta(before, scrape(server.metrics), "spec_gate_engine_failures_total", engine="speculative")
    fell_back = sum(reason == "spec_engine_failure" for _, _, reason in served)
    assert failures >= 1 and fell_back >= 1
    # 3. speculative traffic resumes: the tenant's breaker, opened by the failures, probes again
    resumed = None
    deadline = time.monotonic() + 120
    while resumed is None and time.monotonic() < deadline:
        r = http.generate(PROMPTS[0], PARAMS, api_key=KEY, spec_mode="prod")
        assert r.text == expected[PROMPTS[0]]
        resumed = r.meta["gate_reason"] if r.meta["route"] == "speculative" else None
        time.sleep(1)
    print(f"\nfaults injected: spec_engine killed, spec_engine unloaded (2); {len(served)} requests, all served "
          f"({fell_back} finished on the baseline after a failure), {failures:.0f} failures counted; speculative again: {resumed}")
    assert resumed is not None, "no speculative request within 120 s of the reload"


def test_target_engine_killed_loses_no_request_then_restarts(http, grpc, server):
    """Issue 49: a dead target_engine stub used to fail every request in flight and every new one (a
    400 over HTTP generate, which HAProxy does not retry). spec_engine now finishes them, each as the
    baseline would have (greedy, exact mode), with reason target_engine_failure. Only with both
    engines gone does a client get an error: one that names the engine, within seconds."""
    deadline_s = 60  # a client that waits longer than this counts as hung
    params = GenerateParams(max_tokens=64)
    expected = {p: http.generate(p, params, spec_mode="off").text for p in PROMPTS}
    clients = [HttpClient(http.base, timeout_s=deadline_s), GrpcClient(grpc.url, timeout_s=deadline_s)]

    def one(i: int) -> tuple[str, str, float]:
        """(what the client got: its text, or the error; the reason; seconds)"""
        c, p = clients[i % 2], PROMPTS[i % len(PROMPTS)]
        start = time.monotonic()
        try:
            r = c.generate(p, params, spec_mode="off") if i % 4 < 2 else collect(c.stream(p, params, spec_mode="off"))
            return ("served" if r.text == expected[p] else f"wrong output: {r.text!r}"), r.meta["gate_reason"], time.monotonic() - start
        except Exception as exc:  # an error from the server, or the client's own timeout
            return f"{type(exc).__name__}: {exc}", "", time.monotonic() - start

    try:
        # The engines' compute lock, held here, keeps every request in flight until the kill: on a
        # fast CPU the tokens take under a second, so a sleep alone could miss them all.
        with ThreadPoolExecutor(4) as ex, open(COMPUTE_LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                futures = [ex.submit(one, i) for i in range(4)]
                # killed once all four wait in it, before the gate's first ping (PROBE_AFTER_S of
                # silence): a stub killed amid a ping's IPC can abort tritonserver (see _kill_between_decodes)
                _wait_held(server.metrics, "target_engine", 4, futures)
                _kill("target_engine")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
            outcomes = [f.result(timeout=2 * deadline_s) for f in futures]
        after = one(0)
        print(f"\nfault injected: target_engine killed; in flight: {[(o[:70], r, round(t, 1)) for o, r, t in outcomes]}; "
              f"next request: {after[0][:80]!r} ({after[1]}) in {after[2]:.1f} s")
        for outcome, reason, seconds in outcomes + [after]:
            assert (outcome, reason) == ("served", "target_engine_failure"), outcome
            assert seconds < deadline_s, f"a client waited {seconds:.0f} s"
        # with spec_engine gone too, nothing can serve: a clear error, at once
        _repo(http, "unload", "spec_engine")
        gone = one(0)
        print(f"both engines gone: {gone[0][:120]!r} in {gone[2]:.1f} s")
        assert "target_engine is not answering" in gone[0] and gone[2] < 15, gone
    finally:
        if not _ready(http, "spec_engine"):
            _repo(http, "load", "spec_engine")
        _restart(http, "target_engine")  # the session's later tests need both
        wait_calibrated(TEST_OUT / "model_repository")
    recovered = http.generate(PROMPTS[0], GenerateParams(max_tokens=8), spec_mode="off")
    print(f"after unload + load: {recovered.text!r} ({recovered.meta['gate_reason']})")
    assert recovered.meta["num_output_tokens"] > 0 and recovered.meta["route"] == "baseline"


def test_a_slow_spec_engine_that_answers_pings_is_not_a_failure(http, server):
    """Issue 26: the stall check counted from the last response, so a non-streamed request (one
    response, at the end) on an engine slower than stall_timeout_s failed over to the baseline and
    counted against the breaker, although the engine answered every ping. Here the test holds the
    engines' compute lock past the stall timeout: slow, not dead."""
    stall_s = yaml.safe_load(TEST_POLICY.read_text())["speculative"]["stall_timeout_s"]
    before = scrape(server.metrics)
    with ThreadPoolExecutor(1) as ex, open(COMPUTE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # no engine decodes until it is released
        try:
            # a tenant with a breaker of its own (the other tests here open tenant-failover's)
            pending = ex.submit(http.generate, PROMPTS[0], GenerateParams(max_tokens=16, num_speculative_tokens=4), api_key="tenant-cancel",
                                spec_mode="prod")
            time.sleep(stall_s + 5)
            assert not pending.done(), "served while the engines could not decode: nothing was tested"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        r = pending.result(timeout=300)
    after = scrape(server.metrics)
    print(f"\nspec_engine held {stall_s + 5:.0f} s (stall timeout {stall_s:.0f} s): "
          f"route {r.meta['route']}, reason {r.meta['gate_reason']}")
    assert (r.meta["route"], r.meta["gate_reason"]) == ("speculative", "prod")
    assert delta(before, after, "spec_gate_engine_failures_total", engine="speculative") == 0
