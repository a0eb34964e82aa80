"""Issue 17 against the real front and tritonserver: the official openai client works unchanged, streamed
text equals non-streamed text at T=0 and what `llm` says directly, headers and `extra_body` route,
every response carries the gate's outputs, bad input gets OpenAI-shaped 4xx and the front keeps
serving, an unreachable Triton is a 503, and a client that goes away cancels the Triton stream.

The session server routes baseline by default (policy `mode: off`) and pins free drafting, so a
speculative request drafts; a calibrated engine may still decode plainly (budget 0), which the
metadata then says and the routing checks accept."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import replace

import openai
import pytest
import requests

from loadtest.metrics import delta, scrape, value
from specgate.contract import ENGINE_ACTIVE_METRIC, ENGINE_CANCELLED_METRIC, ENGINE_TOKENS_METRIC
from specgate_client import META, GenerateParams
from specgate_launcher import running_front
from tests.conftest import TEST_OUT
from tests.integration.conftest import free_port
from tests.integration.server_state import engines_idle
from tests.integration.test_gate import live_policy
from tests.integration.test_gate_failover import _kill, _restart

pytestmark = pytest.mark.integration

PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog"
MAX = 16


@pytest.fixture(scope="module")
def oai(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front[0]}/v1", api_key="unused", max_retries=0)


def _chat(oai: openai.OpenAI, stream: bool, **kw):
    return oai.chat.completions.create(model="llm", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX, temperature=0,
                                       stream=stream, **kw)


def _streamed_chat(oai: openai.OpenAI, **kw) -> tuple[str, list]:
    chunks = list(_chat(oai, True, stream_options={"include_usage": True}, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_chat_stream_equals_unary_and_llm_directly(oai, grpc):
    unary = _chat(oai, False)
    text, chunks = _streamed_chat(oai)
    direct = grpc.generate(PROMPT, GenerateParams(max_tokens=MAX)).text  # llm applies the chat template itself
    assert unary.choices[0].message.content == text == direct != ""
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "the front should stream, not send one blob"
    assert chunks[-1].usage == unary.usage
    assert unary.usage.completion_tokens == unary.specgate["num_output_tokens"] > 0
    assert unary.usage.prompt_tokens > 10 and unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens
    assert unary.choices[0].finish_reason in ("stop", "length")


def test_completions_stream_equals_unary_and_llm_directly(oai, grpc):
    prompt = "The three primary colours are"
    unary = oai.completions.create(model="llm", prompt=prompt, max_tokens=MAX, temperature=0)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="llm", prompt=prompt, max_tokens=MAX, stream=True)
                       if c.choices)
    direct = grpc.generate(prompt, GenerateParams(max_tokens=MAX, apply_chat_template=False)).text
    assert unary.choices[0].text == streamed == direct != ""
    assert unary.usage.completion_tokens == MAX and unary.choices[0].finish_reason == "length"


def test_stop_string_is_left_out_streamed_or_not(oai, grpc):
    prompt, stop = "Count from 1 to 10, separated by commas.", "5"
    full = grpc.generate(prompt, GenerateParams(max_tokens=40, stop=[stop])).text
    assert full.endswith(stop)  # llm's own (TensorRT-LLM) semantics
    unary = oai.chat.completions.create(model="llm", messages=[{"role": "user", "content": prompt}], max_tokens=40, stop=[stop])
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": prompt}], max_tokens=40, stop=[stop], stream=True))
    assert unary.choices[0].message.content == streamed == full[: -len(stop)]
    assert unary.choices[0].finish_reason == "stop"


def _assert_speculative(meta: dict) -> None:
    assert (meta["route"], meta["gate_reason"]) == ("speculative", "prod"), meta
    # drafting, or the calibrated engine saying it decodes plainly because drafting does not pay here
    assert meta["num_draft_tokens"] > 0 or meta["draft_budget"] == 0, meta


def test_http_headers_route(oai):
    off = _chat(oai, False, extra_headers={"x-speculative-decoding": "off"})
    assert (off.specgate["route"], off.specgate["gate_reason"]) == ("baseline", "mode_off")
    prod = oai.chat.completions.with_raw_response.create(
        model="llm", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX, extra_headers={"x-speculative-decoding": "prod"})
    body = prod.parse()
    _assert_speculative(body.specgate)
    assert {k: prod.headers[f"x-specgate-{k.replace('_', '-')}"] for k in META} == {k: str(v) for k, v in body.specgate.items()}
    assert body.choices[0].message.content == off.choices[0].message.content  # lossless at T=0
    # x-api-key names the tenant: tenant-prod's policy mode is prod, the org's is off
    tenant = _chat(oai, False, extra_headers={"x-api-key": "tenant-prod"})
    _assert_speculative(tenant.specgate)


def test_streamed_response_headers_and_chunks_carry_the_route(front):
    r = requests.post(f"{front[0]}/v1/chat/completions", stream=True, timeout=120, headers={"x-speculative-decoding": "prod"},
                      json={"model": "llm", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert (r.headers["x-specgate-route"], r.headers["x-specgate-gate-reason"]) == ("speculative", "prod")
    events = [line.removeprefix(b"data: ") for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["specgate"]["route"] == "speculative" for c in chunks)
    _assert_speculative(chunks[-1]["specgate"])


@pytest.mark.parametrize("where", ["openai client", "literal extra_body"])
def test_use_speculative_decoding_routes(oai, front, where):
    def meta(flag: bool) -> dict:
        if where == "openai client":  # merges extra_body into the top level
            return _chat(oai, False, extra_body={"use_speculative_decoding": flag, "speculative_algorithm": "ngram",
                                                 "num_speculative_tokens": 4}).specgate
        body = {"model": "llm", "prompt": PROMPT, "max_tokens": MAX,
                "extra_body": {"use_speculative_decoding": flag, "speculative_algorithm": "ngram", "num_speculative_tokens": 4}}
        r = requests.post(f"{front[0]}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["specgate"]

    _assert_speculative(meta(True))
    assert meta(False)["route"] == "baseline"


BAD = [
    ("bad JSON", b'{"model": "llm", "prompt": ', {}, 400, "not valid JSON"),
    ("wrong type", {"model": "llm", "prompt": "Hi", "max_tokens": "8"}, {}, 400, "max_tokens"),
    ("unsupported field", {"model": "llm", "prompt": "Hi", "logprobs": 2}, {}, 400, "unsupported parameter: logprobs"),
    ("n above one", {"model": "llm", "prompt": "Hi", "n": 2}, {}, 400, "n:"),
    ("unknown model", {"model": "gpt-4o", "prompt": "Hi"}, {}, 404, "gpt-4o"),
    ("max_tokens 0", {"model": "llm", "prompt": "Hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens past the gate's limit (the gate)", {"model": "llm", "prompt": "Hi", "max_tokens": 5000}, {}, 400, "max_tokens"),
    # issue 49: the front tokenized any prompt whole and checked no length
    ("prompt past the context", {"model": "llm", "prompt": "word " * 5000}, {}, 400, "the limit is"),
    ("prompt far past the context", {"model": "llm", "prompt": "word " * 200_000}, {}, 400, "bytes, more than"),
    ("body past the limit", {"model": "llm", "prompt": "word " * 220_000}, {}, 413, "at most"),
    ("unknown algorithm (the gate)", {"model": "llm", "prompt": "Hi", "speculative_algorithm": "medusa"}, {}, 400, "speculative_algorithm"),
    ("malformed header (the gate)", {"model": "llm", "prompt": "Hi"}, {"x-speculative-decoding": "maybe"}, 400, "x-speculative-decoding"),
    ("malformed header, streamed", {"model": "llm", "prompt": "Hi", "stream": True}, {"x-speculative-decoding": "maybe"}, 400,
     "x-speculative-decoding"),
    ("empty prompt (preprocessing)", {"model": "llm", "prompt": ""}, {}, 400, "empty"),
]


@pytest.mark.parametrize("name, body, headers, status, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_an_openai_error_and_the_front_keeps_serving(front, oai, name, body, headers, status, needle):
    kw = ({"data": body, "headers": {"content-type": "application/json", **headers}} if isinstance(body, bytes)
          else {"json": body, "headers": headers})
    r = requests.post(f"{front[0]}/v1/completions", timeout=120, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert oai.completions.create(model="llm", prompt="Say hi.", max_tokens=2).choices[0].text


def test_openai_client_raises_its_own_errors(oai):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model="llm", prompt="Hi", max_tokens=100000)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


def test_models(oai):
    assert [m.id for m in oai.models.list()] == ["llm"]


def test_triton_unreachable_is_502(server):
    ports = replace(server, grpc=free_port(), front=free_port())  # nothing listens on that gRPC port
    with running_front(ports, TEST_OUT / "front-unreachable.log"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports.front}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as exc:
            client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}])
        assert exc.value.status_code == 502 and "unavailable" in exc.value.message


def test_client_disconnect_cancels_the_triton_stream(front):
    base, log = front
    before = log.read_text().count("cancelled the Triton stream")
    with requests.post(f"{base}/v1/completions", stream=True, timeout=120,
                       json={"model": "llm", "prompt": "Count from 1 to 100:", "max_tokens": 64, "stream": True}) as r:
        assert next(line for line in r.iter_lines() if line.startswith(b"data: "))
    # closed after the first chunk, long before 64 tokens
    deadline = time.monotonic() + 20
    while log.read_text().count("cancelled the Triton stream") == before:
        assert time.monotonic() < deadline, "the front did not cancel the Triton stream of a client that went away"
        time.sleep(0.2)


def test_a_non_streamed_client_that_leaves_stops_the_engine(front, server):
    """Issue 26: OpenAI's default, a non-streamed request; its client leaves mid-generation. The front
    cancels its gRPC stream, and the gate's ticks see it, so target_engine
    stops the request (before: it ran to max_tokens, holding its slot)."""
    messages = [{"role": "user", "content": "Write the numbers from 1 to 1000 separated by commas."}]  # 1000 tokens and more
    body = json.dumps({"model": "llm", "messages": messages, "max_tokens": 1000})
    before = engines_idle(server.metrics)
    conn = http.client.HTTPConnection("127.0.0.1", int(front[0].rsplit(":", 1)[1]))
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 120
    while not value(scrape(server.metrics), ENGINE_ACTIVE_METRIC, model="target_engine"):
        assert time.monotonic() < deadline, "target_engine never started the request"
        time.sleep(0.2)
    conn.close()
    after = engines_idle(server.metrics)
    generated = delta(before, after, ENGINE_TOKENS_METRIC, model="target_engine")
    print(f"\nnon-streamed OpenAI client left: target_engine generated {generated:.0f} of 1000")
    assert delta(before, after, ENGINE_CANCELLED_METRIC, model="target_engine") == 1
    assert generated < 1000


def test_overload_is_503_with_retry_after(front, grpc):
    """Issue 26: the gate's `overloaded: ... retry later` reached OpenAI clients as a 400, which their
    SDKs do not retry. One slot and no queue: a second request is refused at once."""
    body = {"model": "llm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    with live_policy(lambda p: p.update(admission={"max_concurrent": 1, "max_queued": 0, "queue_timeout_s": 2})):
        holder = grpc.stream("Write the numbers from 1 to 1000 separated by commas.", GenerateParams(max_tokens=300), spec_mode="off")
        next(holder)  # it holds the one slot
        try:
            unary = requests.post(f"{front[0]}/v1/chat/completions", json=body, timeout=60)
            streamed = requests.post(f"{front[0]}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        finally:
            holder.close()
    for r in (unary, streamed):
        print(f"\noverloaded: HTTP {r.status_code} Retry-After {r.headers.get('retry-after')}: {r.text[:160]}")
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
        assert "overloaded" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"


def test_a_dead_target_engine_loses_no_request(front, http):
    """Issue 49: a dead target_engine stub failed every request (the front answered 503; Triton's own
    generate answered 400, which HAProxy does not retry). spec_engine now serves them: streamed or
    not, the client sees its answer, with the reason."""
    body = {"model": "llm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    try:
        _kill("target_engine")
        for stream in (False, True):
            r = requests.post(f"{front[0]}/v1/chat/completions", json={**body, "stream": stream}, headers={"x-speculative-decoding": "off"},
                              timeout=300)
            print(f"\ntarget_engine killed, stream={stream}: HTTP {r.status_code}: {r.text[-300:]}")
            assert r.status_code == 200, r.text
            last = json.loads(r.text.split("data: ")[-2]) if stream else r.json()
            assert "error" not in last and last["specgate"]["gate_reason"] == "target_engine_failure", r.text
    finally:
        _restart(http, "target_engine")
    assert requests.post(f"{front[0]}/v1/chat/completions", json=body, timeout=300).status_code == 200
