"""Issue 2 against a real tritonserver: protocols agree, streaming is lossless text, bad input gets
a clear error and the server keeps serving, concurrent streams stay separate, seeds reproduce."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from specgate_client import GenerateParams, ServerError, collect
from tests.prompts import GREEDY_PROMPTS, UNICODE_PROMPTS

GREEDY = GenerateParams(max_tokens=32)


@pytest.mark.parametrize("prompt", UNICODE_PROMPTS + GREEDY_PROMPTS[:2])
def test_protocols_return_same_text(http, grpc, prompt):
    unary = http.generate(prompt, GREEDY)
    sse = collect(http.stream(prompt, GREEDY))
    g = grpc.generate(prompt, GREEDY)
    assert unary.text
    assert sse.text == unary.text
    assert g.text == unary.text
    assert len(sse.chunks) > 1, "generate_stream should stream, not send one blob"
    assert sse.meta["num_output_tokens"] == unary.meta["num_output_tokens"] > 0


def test_seeded_sampling(http):
    p = GenerateParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a, b = http.generate("Invent a name for a spaceship.", p), http.generate("Invent a name for a spaceship.", p)
    c = http.generate("Invent a name for a spaceship.", GenerateParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99))
    assert a.text == b.text
    assert a.text != c.text


def test_stop_string(http):
    full = http.generate("Count from 1 to 10, separated by commas.", GenerateParams(max_tokens=40)).text
    assert "5" in full
    stopped = http.generate("Count from 1 to 10, separated by commas.", GenerateParams(max_tokens=40, stop=["5"])).text
    assert stopped.endswith("5") and len(stopped) < len(full)


def test_ten_concurrent_streams(http, grpc):
    prompts = GREEDY_PROMPTS[:10]
    solo = {p: http.generate(p, GREEDY).text for p in prompts}

    def run(i: int) -> tuple[str, str]:
        p = prompts[i]
        client_stream = http.stream if i % 2 else (lambda pr, pa: grpc.stream(pr, pa))
        return p, collect(client_stream(p, GREEDY)).text

    with ThreadPoolExecutor(10) as ex:
        results = list(ex.map(run, range(10)))
    for p, text in results:
        assert text == solo[p], f"concurrent output differs for {p!r}"


# -- bad input ---------------------------------------------------------------------------------
BAD = [
    ("empty prompt", {"text_input": ""}, "empty"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens over limit", {"max_tokens": 100000}, "max_tokens"),
    ("negative temperature", {"temperature": -1.0}, "temperature"),
    ("top_p zero", {"top_p": 0.0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("prompt past context", {"text_input": "word " * 5000}, "limit"),
    # issue 49: refused by its size, before it is tokenized (it was tokenized whole first)
    ("prompt far past context", {"text_input": "word " * 200_000}, "bytes, more than"),
    ("too many stop strings", {"stop": [f"s{i}" for i in range(17)]}, "17 stop strings; at most 16"),
    ("stop string too long", {"stop": ["x" * 257]}, "257 bytes; at most 256"),
    ("unknown algorithm", {"speculative_algorithm": "medusa"}, "speculative_algorithm"),
    ("malformed header", {"x-speculative-decoding": "maybe"}, "x-speculative-decoding"),
]


def _assert_still_serving(http) -> None:
    assert http.generate("Say hi.", GenerateParams(max_tokens=4)).text


@pytest.mark.parametrize("name, fields, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_http(http, name, fields, needle):
    body = {"text_input": "Hello", "max_tokens": 8, **fields}
    r = requests.post(f"{http.base}/v2/models/llm/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]
    # the streaming endpoint reports the same error in-band
    r = requests.post(f"{http.base}/v2/models/llm/generate_stream", json={**body, "stream": True}, timeout=60)
    assert needle in r.text
    _assert_still_serving(http)


@pytest.mark.parametrize("name, fields, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_grpc(grpc, http, name, fields, needle):
    fields = dict(fields)
    header = fields.pop("x-speculative-decoding", None)
    prompt = fields.pop("text_input", "Hello")
    p = GenerateParams(**{"max_tokens": 8, **fields})
    with pytest.raises(ServerError, match=needle):
        grpc.generate(prompt, p, spec_mode=header)
    _assert_still_serving(http)


def test_invalid_utf8(grpc, http):
    with pytest.raises(ServerError, match="text_input is not valid UTF-8"):
        grpc.generate(b"caf\xc3 \xff\xfe", GREEDY)
    text, stop = grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stop", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
    stop.set_data_from_numpy(np.array([b"\xff"], dtype=np.object_))
    with pytest.raises(ServerError, match="stop is not valid UTF-8"):  # named: it is not the prompt
        list(grpc.stream("", GREEDY, raw_inputs=[text, stop]))
    r = requests.post(f"{http.base}/v2/models/llm/generate", data=b'{"text_input": "caf\xc3 \xff", "max_tokens": 4}', timeout=60)
    assert r.status_code == 400
    _assert_still_serving(http)


def test_missing_text_input(grpc, http):
    r = requests.post(f"{http.base}/v2/models/llm/generate", json={"max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "text_input is required" in r.json()["error"]
    mt = grpcclient.InferInput("max_tokens", [1], "INT32")
    mt.set_data_from_numpy(np.array([4], np.int32))
    with pytest.raises(ServerError, match="text_input is required"):
        list(grpc.stream("", GREEDY, raw_inputs=[mt]))
    _assert_still_serving(http)


def test_wrong_dtype(grpc, http):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
    mt = grpcclient.InferInput("max_tokens", [1], "FP32")
    mt.set_data_from_numpy(np.array([4.0], np.float32))
    with pytest.raises(ServerError, match="max_tokens"):
        list(grpc.stream("", GREEDY, raw_inputs=[text, mt]))
    # HTTP: Triton's own JSON parser rejects a string for an INT32 input before any model runs
    r = requests.post(f"{http.base}/v2/models/llm/generate", json={"text_input": "Hello", "max_tokens": "four"}, timeout=60)
    assert r.status_code >= 400
    _assert_still_serving(http)
