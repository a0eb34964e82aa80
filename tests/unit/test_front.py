"""The OpenAI front without a model: request validation, error shapes, stop strings, error classes, and
502 while Triton is unreachable (the app is served in-process by starlette's TestClient)."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from specgate_front import create_app
from specgate_front.schemas import ChatCompletionRequest, CompletionRequest
from specgate_front.stops import StopTrimmer
from specgate_front.triton import classify

CHAT = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client():
    """The front in front of a port where no Triton listens."""
    with TestClient(create_app(f"localhost:{_free_port()}")) as c:
        yield c


# -- request models ------------------------------------------------------------------------------
def test_speculative_knobs_top_level_and_in_extra_body():
    knobs = {"use_speculative_decoding": True, "num_speculative_tokens": 5, "speculative_algorithm": "eagle"}
    top = ChatCompletionRequest.model_validate({**CHAT, **knobs})
    nested = ChatCompletionRequest.model_validate({**CHAT, "extra_body": knobs})
    for r in (top, nested):
        p = r.generate_params(r.output_limit())
        assert (p.use_speculative_decoding, p.num_speculative_tokens, p.speculative_algorithm) == (True, 5, "eagle")


def test_field_in_both_places_is_rejected():
    with pytest.raises(ValidationError, match="both at the top level and in extra_body"):
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 4, "extra_body": {"max_tokens": 8}})


@pytest.mark.parametrize("field, value",
                         [("max_tokens", "8"), ("temperature", "0.5"), ("stream", 1), ("seed", 1.5), ("n", 2), ("logprobs", True)])
def test_wrong_types_and_unsupported_fields(field, value):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, field: value})


def test_defaults_are_the_llm_models_and_an_int_temperature_is_a_float():
    p = ChatCompletionRequest.model_validate(CHAT).generate_params(None)
    assert (p.max_tokens, p.temperature, p.top_p, p.apply_chat_template) == (128, 0.0, 1.0, False)
    r = ChatCompletionRequest.model_validate({**CHAT, "temperature": 1, "max_completion_tokens": 7, "stop": "x"})
    p = r.generate_params(r.output_limit())
    assert (p.temperature, p.max_tokens, p.stop) == (1.0, 7, ["x"])


def test_completion_prompt_is_one_string():
    assert CompletionRequest.model_validate({"model": "llm", "prompt": ["a"]}).text() == "a"
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"model": "llm", "prompt": ["a", "b"]})


# -- stop strings --------------------------------------------------------------------------------
@pytest.mark.parametrize("stops, text, expected", [
    ([], "abc", "abc"),
    ([", 7"], "4, 5, 6, 7", "4, 5, 6"),
    (["b", "ab"], "xxab", "xx"),  # the longer one matched first
    (["STOP"], "no stop here", "no stop here"),
])
def test_stop_trimmer_streamed_equals_whole(stops, text, expected):
    whole = StopTrimmer(stops)
    assert whole.push(text) + whole.finish() == expected
    streamed, out = StopTrimmer(stops), ""
    for ch in text:  # one character per delta: the stop string arrives in pieces
        out += streamed.push(ch)
    assert out + streamed.finish() == expected


def test_stop_trimmer_without_stops_holds_nothing_back():
    assert StopTrimmer([]).push("abc") == "abc"


# -- Triton errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("message, status, retry", [
    ("in ensemble 'llm', max_tokens must be between 1 and 1024, got 0", 400, None),
    ("in ensemble 'llm', x-speculative-decoding: invalid value 'maybe'; allowed: off, shadow, prod", 400, None),
    ("in ensemble 'llm', input_ids: token id 99999 is not in the model's vocabulary ([0, 49152))", 400, None),
    ("in ensemble 'llm', target_engine: stub died", 500, None),
    ("in ensemble 'llm', gate error: boom", 500, None),
    ("Request for unknown model: 'llm' is not found", 502, None),
    # the gate's own wording (gate/admission.py, serving/engine_client.py): issue 26 found these as 400
    ("in ensemble 'llm', overloaded: 1 requests already queued (admission.max_queued); retry later", 503, 1),
    ("in ensemble 'llm', overloaded: no free slot within 2 s (admission.queue_timeout_s); retry later", 503, 1),
    # this replica cannot serve it, another may: 502, which HAProxy retries (it does not retry 503: issue 49)
    ("in ensemble 'llm', target_engine is not answering: no answer to a control message in 10 s", 502, None),
])
def test_classify(message, status, retry):
    err = classify(message)
    assert (err.status, err.retry_after_s) == (status, retry)
    assert "in ensemble" not in err.message


# -- the app ------------------------------------------------------------------------------------
def _assert_openai_error(r, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")


@pytest.mark.parametrize("body, needle", [
    (b'{"model": "llm", "messages": [', "not valid JSON"),
    (b'[1, 2]', "must be a JSON object"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "8"}', "max_tokens"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "tools": []}', "unsupported parameter: tools"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "n": 3}', "n:"),
    (b'{"model": "llm", "messages": []}', "messages"),
    (b'{"model": "llm", "messages": [{"role": "tool", "content": "Hi"}]}', "role"),
    # issue 49: what the `llm` inputs' types cannot hold (numpy 1.x wrapped 2**32 + 1 to 1; a seed of
    # 2**63 was a 500), and stop lists past the bounds the models keep (16 strings of 256 bytes)
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4294967297}', "max_tokens"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}', "max_completion_tokens"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "seed": 9223372036854775808}', "seed"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "num_speculative_tokens": 2147483648}', "num_speculative_tokens"),
    (json.dumps({**CHAT, "stop": [str(i) for i in range(17)]}).encode(), "17 stop strings; at most 16"),
    (json.dumps({**CHAT, "stop": "x" * 257}).encode(), "257 bytes; at most 256"),
])
def test_bad_requests_are_openai_shaped_400s(client, body, needle):
    _assert_openai_error(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400, needle)


def test_a_body_past_the_limit_is_413_before_it_is_read(client):
    """Issue 49: no side limited a body's size; Starlette reads it whole. Declared or chunked."""
    from specgate_front.body_limit import MAX_BODY_BYTES

    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}).encode()
    _assert_openai_error(client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"}), 413, "at most")
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: chunked
    _assert_openai_error(client.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"}), 413, "at most")


def test_unknown_model_is_404(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    _assert_openai_error(r, 404, "gpt-4o")
    assert r.json()["error"]["code"] == "model_not_found"


def test_unknown_route_is_openai_shaped(client):
    _assert_openai_error(client.get("/v1/embeddings"), 404, "Not Found")


@pytest.mark.parametrize("path, body",
                         [("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "llm", "prompt": "Hi", "stream": True})])
def test_triton_unreachable_is_502(client, path, body):
    """502, which HAProxy retries on another replica (issue 49: it no longer retries 503, overload)."""
    r = client.post(path, json=body)
    _assert_openai_error(r, 502, "unavailable")
    assert r.json()["error"]["code"] == "service_unavailable"


def test_models_lists_llm(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["llm"]


# -- readiness -----------------------------------------------------------------------------------
class _Triton:
    """Triton's gRPC answers the readiness check reads, made up."""

    def __init__(self, server: bool = True, model: bool = True, calibration: str | None = None) -> None:
        self.server, self.model, self.calibration = server, model, calibration

    async def is_server_ready(self) -> bool:
        return self.server

    async def is_model_ready(self, name: str) -> bool:
        return self.model and name == "llm"

    async def get_model_config(self, name: str, as_json: bool) -> dict:
        assert name == "spec_gate" and as_json
        params = {} if self.calibration is None else {"calibration_path": {"string_value": self.calibration}}
        return {"config": {"name": name, "parameters": params}}

    async def close(self) -> None:
        pass


@pytest.fixture
def triton_http():
    """Triton's HTTP /v2/health/ready, made up: `state["status"]` is what it answers; None closes it."""
    state: dict = {"status": 200}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if state["status"] is None:
                self.connection.close()  # a draining tritonserver's closed port
                return
            self.send_response(state["status"] if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_port}", state
    server.shutdown()


def test_ready_only_when_triton_the_model_and_a_calibration_are(tmp_path, client, triton_http):
    assert client.get("/health/ready").status_code == 503  # no Triton at all
    assert "unavailable" in client.get("/health/ready").json()["reason"]
    http_url, http = triton_http
    published = tmp_path / "calibration.json"
    with TestClient(create_app(f"localhost:{_free_port()}", http_url=http_url)) as c:
        cases = [
            (_Triton(server=False, calibration=str(published)), 503, "tritonserver at localhost:.* is not ready"),  # loading
            (_Triton(model=False, calibration=str(published)), 503, "model 'llm' is not ready"),
            (_Triton(calibration=str(published)), 503, "no calibration yet"),  # spec_engine still measures
        ]
        for fake, status, reason in cases:
            c.app.state.triton.client = fake
            r = c.get("/health/ready")
            assert r.status_code == status and re.search(reason, r.json()["reason"]), r.json()
        published.write_text("{}")
        assert c.get("/health/ready").json() == {"ready": True, "reason": None}
        # draining: Triton's HTTP port closes at SIGTERM while its gRPC ServerReady still says true
        for closed in (503, None):
            http["status"] = closed
            r = c.get("/health/ready")
            assert r.status_code == 503 and r.json()["reason"] == f"tritonserver at {http_url} is not ready"
        http["status"] = 200
        c.app.state.triton.client = _Triton(calibration=None)  # tensorrtllm engines publish none
        assert c.get("/health/ready").status_code == 200
