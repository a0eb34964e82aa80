"""Issue 4 against a real tritonserver: routes, breaker, metrics, shadow, live policy edits.

The server runs tests/integration/policy.yaml (org mode off, tenants with their own modes, a fast
breaker) with fp32 engines; the speculative default there is n-gram, which needs no trained weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from loadtest.metrics import delta, delta_by, scrape, value
from specgate.contract import SPEC_ALGORITHMS
from specgate.gate.tenants import hash_key
from specgate_client import GenerateParams, ServerError, collect
from tests.conftest import COMPUTE_LOCK, TEST_KEYS, TEST_OUT, TEST_POLICY

GREEDY = GenerateParams(max_tokens=24, num_speculative_tokens=4)
# The gate looks at its policy and key files when a request arrives, at most once a second
# (gate/policy.py): the first request this long after an edit is decided on the edited files.
RELOAD_S = 1.2
# n-gram drafting finds its continuation in the prompt: high acceptance (0.67-0.83 measured at k=4),
# so tests that are not about the breaker never trip it (anonymous requests share the org breaker).
ECHO = "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog by the river."
CAPS = "Rewrite this sentence in all capital letters: the weather today is sunny and warm with a light breeze."
PROMPT = ECHO
COUNT = "Write the numbers from 1 to 1000 separated by commas."  # at T=0 it counts on past 400 tokens
# nothing to copy, and long drafts: low acceptance
NOVEL = [
    "Invent a name for a new color and describe it.",
    "Write a two-line poem about a lighthouse.",
    "What would a cat say about Mondays?",
    "Describe the taste of rain in one sentence.",
]


@contextlib.contextmanager
def live_policy(edit, keys: dict[str, str] | None = None):
    """Apply `edit(policy dict)` to the server's live policy copy for the block, and add `keys`
    (tenant name -> API key) to its key file; then restore both."""
    original, original_keys = TEST_POLICY.read_text(), TEST_KEYS.read_text()
    policy = yaml.safe_load(original)
    edit(policy)
    key_file = yaml.safe_load(original_keys)
    key_file.update({name: [hash_key(key)] for name, key in (keys or {}).items()})
    for path, data in ((TEST_KEYS, key_file), (TEST_POLICY, policy)):  # keys first: the policy needs them
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(data))
        tmp.replace(path)
    time.sleep(RELOAD_S)
    try:
        yield
    finally:
        TEST_POLICY.write_text(original)
        TEST_KEYS.write_text(original_keys)
        time.sleep(RELOAD_S)


def route_of(client, prompt=PROMPT, params=GREEDY, **kw) -> tuple[str, str, str]:
    r = client.generate(prompt, params, **kw)
    return r.meta["route"], r.meta["gate_reason"], r.text


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_modes_and_headers_select_routes(request, proto):
    c = request.getfixturevalue(proto)
    base = route_of(c)
    assert base[:2] == ("baseline", "mode_off")  # org default is off
    assert route_of(c, spec_mode="prod")[:2] == ("speculative", "prod")
    assert route_of(c, api_key="tenant-prod")[:2] == ("speculative", "prod")
    assert route_of(c, api_key="tenant-prod", spec_mode="off")[:2] == ("baseline", "mode_off")  # header wins
    assert route_of(c, api_key="nobody")[:2] == ("baseline", "mode_off")  # unknown tenant -> org default
    hot = GenerateParams(max_tokens=8, temperature=0.9, seed=1, num_speculative_tokens=4)
    assert route_of(c, params=hot, spec_mode="prod")[:2] == ("baseline", "temperature")
    on = GenerateParams(max_tokens=24, num_speculative_tokens=4, use_speculative_decoding=True)
    assert route_of(c, params=on)[:2] == ("speculative", "prod")
    shadow = route_of(c, api_key="tenant-shadow")
    assert shadow[:2] == ("baseline", "shadow")
    # lossless: speculative and shadow-served text equal the baseline's (fp32, greedy)
    assert route_of(c, spec_mode="prod")[2] == base[2] == shadow[2]


def test_metrics_move_by_reported_counts(http, server):
    before = scrape(server.metrics)
    r = http.generate(CAPS, GenerateParams(max_tokens=48, num_speculative_tokens=4), spec_mode="prod")
    after = scrape(server.metrics)
    assert r.meta["route"] == "speculative" and r.meta["num_draft_tokens"] > 0
    assert delta(before, after, "spec_decode_num_draft_tokens_total") == r.meta["num_draft_tokens"]
    assert delta(before, after, "spec_decode_num_accepted_tokens_total") == r.meta["num_accepted_tokens"]
    assert delta(before, after, "spec_gate_decisions_total", route="speculative", reason="prod") == 1
    per_pos = sum(delta_by(before, after, "spec_decode_num_accepted_tokens_per_pos_total", "position").values())
    assert per_pos == r.meta["num_accepted_tokens"]
    assert delta(before, after, "spec_decode_num_drafts_total") >= 1
    assert any(n.startswith("spec_gate_decision_latency_seconds") for n, _ in after)


def test_shadow_counts_zero_mismatches_in_fp32(http, server):
    before = scrape(server.metrics)
    for p in [ECHO, CAPS, ECHO]:
        r = http.generate(p, GREEDY, api_key="tenant-shadow")
        assert r.meta["route"] == "baseline" and r.meta["gate_reason"] == "shadow"
        assert r.text == http.generate(p, GREEDY, spec_mode="off").text
    deadline = time.time() + 120  # mirrors finish after the served responses
    while delta(before, scrape(server.metrics), "spec_gate_shadow_comparisons_total") < 3 and time.time() < deadline:
        time.sleep(1)
    after = scrape(server.metrics)
    assert delta(before, after, "spec_gate_shadow_comparisons_total") == 3
    assert delta(before, after, "spec_gate_shadow_mismatch_total") == 0


def _spec(http, prompt, key, k=8):
    return http.generate(prompt, GenerateParams(max_tokens=32, num_speculative_tokens=k), api_key=key)


def test_breaker_trips_one_tenant_and_recovers(http, server):
    # tenant-a: low acceptance until its circuit opens
    reasons = []
    for i in range(12):
        r = _spec(http, NOVEL[i % len(NOVEL)], "tenant-a")
        reasons.append(r.meta["gate_reason"])
        if r.meta["gate_reason"] == "circuit_open":
            break
    assert reasons[-1] == "circuit_open", f"breaker never opened: {reasons}"
    # tenant-b is isolated: still speculative
    assert _spec(http, ECHO, "tenant-b").meta["route"] == "speculative"
    m = scrape(server.metrics)
    assert any(n == "spec_gate_circuit_open" and v == 1.0 for (n, _), v in m.items())
    # after the cooldown, probes with high acceptance close the circuit again
    time.sleep(3.5)
    seen = []
    for _ in range(16):
        r = _spec(http, ECHO, "tenant-a", k=4)
        seen.append(r.meta["gate_reason"])
        if seen[-2:] == ["prod", "prod"]:
            break
    assert "half_open_probe" in seen and seen[-1] == "prod", seen


def test_policy_edit_takes_effect_live(http):
    assert route_of(http)[:2] == ("baseline", "mode_off")
    original = TEST_POLICY.read_text()
    policy = yaml.safe_load(original)
    try:
        policy["mode"] = "prod"
        tmp = TEST_POLICY.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(policy))
        tmp.replace(TEST_POLICY)
        deadline = time.time() + 10
        while route_of(http)[0] != "speculative":
            assert time.time() < deadline, "policy edit not picked up within 10 s"
            time.sleep(0.5)
        # an invalid edit is rejected and the previous (prod) policy stays
        TEST_POLICY.write_text("mode: sometimes\n")
        time.sleep(RELOAD_S)
        assert route_of(http)[0] == "speculative"
    finally:
        TEST_POLICY.write_text(original)
        time.sleep(RELOAD_S)
    assert route_of(http)[0] == "baseline"


def test_load_hands_a_running_speculative_request_over(http, grpc):
    """With load.max_in_flight 1, a speculative request that started alone continues on the batched
    baseline once a second request arrives: same text (fp32, greedy), final route baseline, reason load."""
    # A request that runs for a second or more: the copy prompt's answer (about 20 tokens, drafted a
    # handful at a time) was over before the second request arrived once exact mode got faster
    long = GenerateParams(max_tokens=400, num_speculative_tokens=4)
    expected = http.generate(COUNT, long, spec_mode="off").text
    with live_policy(lambda p: p.update(load={"max_in_flight": 1})):
        stream = grpc.stream(COUNT, long, spec_mode="prod")
        first = next(stream)
        assert first.meta["route"] == "speculative", first.meta
        second = http.generate(CAPS, GREEDY, spec_mode="prod")  # arrives while the first runs
        assert second.meta["gate_reason"] == "load"
        rest = list(stream)
        text = first.text + "".join(c.text for c in rest)
        assert rest[-1].meta["route"] == "baseline" and rest[-1].meta["gate_reason"] == "load", rest[-1].meta
        assert text == expected


def test_policy_without_k_sends_the_engines_default_for_the_algorithm(http, server):
    """speculative.num_speculative_tokens null (the shipped policy): the gate sends no k and
    spec_engine drafts its own default for the algorithm (eagle2: 8-node trees), not some fixed k."""
    def edit(policy: dict) -> None:
        policy["speculative"].update(algorithm="eagle2", num_speculative_tokens=None)
        policy["tenants"]["team-defaults"] = {"mode": "prod"}  # its own breaker: shares nothing

    with live_policy(edit, keys={"team-defaults": "tenant-defaults"}):
        before = scrape(server.metrics)
        r = http.generate(NOVEL[0], GenerateParams(max_tokens=48), api_key="tenant-defaults")
        after = scrape(server.metrics)
        assert r.meta["route"] == "speculative", r.meta
        drafts = delta(before, after, "spec_decode_num_drafts_total")
        # 8 nodes per step until the last steps' budget (max_tokens) trims the tree; the old
        # policy value, 4, would cap it at 4
        assert drafts > 0 and r.meta["num_draft_tokens"] / drafts > 6, (r.meta, drafts)


def test_every_algorithm_serves_losslessly_through_triton(http, grpc):
    """Each drafter spec_engine loads, chosen per request at its own default size: routed
    speculative, drafts something, and returns the baseline's text (fp32 greedy) over unary HTTP
    and streamed gRPC. One tenant per algorithm, so a weak drafter's breaker cannot hide the next."""
    def edit(policy: dict) -> None:
        policy["speculative"]["num_speculative_tokens"] = None
        policy["tenants"].update({f"team-algo-{a}": {"mode": "prod", "algorithm": a} for a in SPEC_ALGORITHMS})

    expected = http.generate(CAPS, GenerateParams(max_tokens=24)).text
    with live_policy(edit, keys={f"team-algo-{a}": f"algo-{a}" for a in SPEC_ALGORITHMS}):
        for algorithm in SPEC_ALGORITHMS:
            unary = http.generate(CAPS, GenerateParams(max_tokens=24), api_key=f"algo-{algorithm}")
            streamed = collect(grpc.stream(CAPS, GenerateParams(max_tokens=24), api_key=f"algo-{algorithm}"))
            for r in (unary, streamed):
                assert r.meta["route"] == "speculative" and r.meta["num_draft_tokens"] > 0, (algorithm, r.meta)
                assert r.text == expected, algorithm


def test_a_tenant_without_allow_override_cannot_choose_its_mode(http, grpc, server):
    before = scrape(server.metrics)
    assert route_of(http, api_key="tenant-locked", spec_mode="prod")[:2] == ("baseline", "mode_off")
    on = GenerateParams(max_tokens=8, num_speculative_tokens=4, use_speculative_decoding=True)
    assert route_of(grpc, params=on, api_key="tenant-locked")[:2] == ("baseline", "mode_off")
    ignored = delta_by(before, scrape(server.metrics), "spec_gate_override_ignored_total", "tenant")
    assert list(ignored.values()) == [2] and "org" not in ignored  # both counted under its own label


def test_raw_keys_never_reach_logs_metrics_or_errors(http, grpc, server):
    """Known, unknown and refused keys, over both protocols and through the error paths: none shows
    up in the server's log (the gate logs there), on /metrics, or in an error the client gets."""
    unknown = f"unknown-key-{uuid.uuid4().hex}"
    refused = f"refused-key-{uuid.uuid4().hex}"
    known = "tenant-prod"
    errors: list[str] = []

    def attempt(call) -> None:
        try:
            call()
        except ServerError as exc:
            errors.append(str(exc))

    short = GenerateParams(max_tokens=4, num_speculative_tokens=4)
    for key in (known, unknown):
        attempt(lambda: http.generate(PROMPT, short, api_key=key))
        attempt(lambda: collect(grpc.stream(PROMPT, short, api_key=key)))
        attempt(lambda: http.generate(PROMPT, short, api_key=key, spec_mode="maybe"))  # malformed header
        attempt(lambda: collect(grpc.stream(PROMPT, short, api_key=key, spec_mode="maybe")))
    with live_policy(lambda p: p.update(unknown_tenant="reject")):
        attempt(lambda: http.generate(PROMPT, short, api_key=refused))
        attempt(lambda: collect(grpc.stream(PROMPT, short, api_key=refused)))
    assert len(errors) == 6, errors  # 4 malformed headers, 2 refused keys
    time.sleep(1)  # the stubs' log lines reach the server log
    haystacks = {
        "errors": "\n".join(errors),
        "metrics": requests.get(f"http://localhost:{server.metrics}/metrics", timeout=10).text,
        "server log": (TEST_OUT / "tritonserver.log").read_text(errors="replace"),
    }
    for where, text in haystacks.items():
        for key in (known, unknown, refused):
            assert key not in text, f"{key} found in the {where}"


def test_series_exist_at_zero_before_their_first_event(server):
    """On the real metrics endpoint: counters a shadow mismatch, an ignored override or a draft
    position would create are there from load (the suite's shadow mirrors never mismatch in fp32)."""
    m = scrape(server.metrics)
    names = {(n, tuple(sorted(dict(labels)))) for n, labels in m}
    for name in ("spec_gate_shadow_mismatch_total", "spec_gate_shadow_comparisons_total", "spec_decode_num_drafts_total"):
        assert (name, ()) in names, name
    assert ("spec_gate_override_ignored_total", frozenset({("tenant", "org")})) in m
    tenants = {dict(labels)["tenant"] for n, labels in m if n == "spec_gate_circuit_open"}
    assert "org" in tenants and len(tenants) >= 7  # org + the six tenants of the suite's key file
    positions = {dict(labels)["position"] for n, labels in m if n == "spec_decode_num_accepted_tokens_per_pos_total"}
    assert positions >= {str(i) for i in range(8)}  # max_num_speculative_tokens: 8


def test_overload_is_refused_as_unavailable_and_counted(http, grpc, server):
    """One slot, one queue place: a request that finds the queue full is refused at once over every
    protocol; the queued one is refused when its wait times out. The gate answers UNAVAILABLE, but
    Triton 2.51's generate endpoints send 400 for any model error and gRPC streams carry no status,
    so clients see the "overloaded:" message (docs/gate.md, 'Admission'). The 400s pin what 2.51
    does: an upgrade that maps the code to 503 fails here, and the docs need updating."""
    long = GenerateParams(max_tokens=600)  # greedy, this prompt loops
    short = GenerateParams(max_tokens=4)
    body = {"text_input": PROMPT, "max_tokens": 4}
    with live_policy(lambda p: p.update(admission={"max_concurrent": 1, "max_queued": 1, "queue_timeout_s": 2})):
        before = scrape(server.metrics)
        holder = grpc.stream("Repeat the word 'apple' one thousand times.", long, spec_mode="off")
        next(holder)  # it is being served
        # Its decodes wait on the engines' compute lock while the test holds it, so it keeps the slot
        # past the queue timeout however fast this machine decodes (600 tokens took 2 s on an AMX Xeon).
        with ThreadPoolExecutor(1) as ex, open(COMPUTE_LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            queued = ex.submit(http.generate, PROMPT, short)
            time.sleep(0.5)  # it waits in the queue
            t0 = time.monotonic()
            unary = requests.post(f"{http.base}/v2/models/llm/generate", json=body, timeout=60)
            sse = requests.post(f"{http.base}/v2/models/llm/generate_stream", json={**body, "stream": True}, timeout=60)
            with pytest.raises(ServerError) as grpc_err:
                collect(grpc.stream(PROMPT, short))
            refused_in = time.monotonic() - t0
            with pytest.raises(ServerError) as timed_out:
                queued.result(timeout=60)
            fcntl.flock(lock, fcntl.LOCK_UN)
        rest = list(holder)
        after = scrape(server.metrics)
    assert refused_in < 2.5  # at once, not after the queue timeout
    full = "in ensemble 'llm', overloaded: 1 requests already queued (admission.max_queued); retry later"
    assert (unary.status_code, unary.json()["error"]) == (400, full)
    assert sse.status_code == 400 and json.loads(sse.text.removeprefix("data:"))["error"] == full
    assert str(grpc_err.value) == full
    assert timed_out.value.status == 400 and "overloaded: no free slot within 2 s" in str(timed_out.value)
    assert rest[-1].meta["num_output_tokens"] > 4  # the request holding the slot was not disturbed
    assert delta(before, after, "spec_gate_overloaded_total", reason="queue_full") == 3
    assert delta(before, after, "spec_gate_overloaded_total", reason="queue_timeout") == 1
    assert value(after, "spec_gate_queued") == 0


def test_a_tiny_temperature_is_greedy_not_an_engine_failure(http, server):
    """1e-40 used to overflow spec_engine's logits: every such request failed over to the baseline
    and counted against the (shared) breaker. Below 1e-5 it is greedy, in the gate and the engines."""
    before = scrape(server.metrics)
    greedy = http.generate(CAPS, GREEDY, spec_mode="off").text
    r = http.generate(CAPS, GenerateParams(max_tokens=24, num_speculative_tokens=4, temperature=1e-40), spec_mode="prod")
    assert (r.meta["route"], r.meta["gate_reason"], r.text) == ("speculative", "prod", greedy)
    assert delta(before, scrape(server.metrics), "spec_gate_engine_failures_total", engine="speculative") == 0
