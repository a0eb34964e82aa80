"""Issue 26, items 1 and 4, against the real server: who may steer the engines, and what a bad prompt
sent past preprocessing does.

1. The engine models (and spec_gate's cancel message) obey only callers with the server's engine key:
   before, anyone who reached Triton could pin spec_engine's calibration (written to the file the
   gate routes on), hand every request over, or generate without the gate's admission.
4. Token ids outside the vocabulary, sent straight to spec_gate, are the client's error, named, and
   never count against the breaker: before, spec_engine's refusal counted as an engine failure, and
   three such calls opened the breaker that every keyless client shares.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadtest.metrics import delta, scrape
from specgate.contract import (
    HEADER_SPEC_MODE,
    PARAM_ALGORITHM,
    PARAM_CALIBRATE,
    PARAM_CANCEL,
    PARAM_ENGINE_KEY,
    PARAM_HAND_OVER,
    PARAM_PING,
    engine_inputs,
)
from specgate_client import GenerateParams, ServerError, stream_engine
from specgate_launcher import engine_key
from tests.conftest import TEST_OUT
from tests.integration.test_gate import ECHO

CALIBRATION = TEST_OUT / "engines" / "cpu" / "calibration.json"
IDS = [1, 504, 1056, 30]  # any in-vocabulary prompt
VOCAB = 49152  # SmolLM2's


def _refused(url: str, model: str, arrays: dict[str, np.ndarray], params: dict, key: str | None = None) -> str:
    with pytest.raises(ServerError) as err:
        list(stream_engine(url, model, arrays, params, ["text_output" if model == "spec_gate" else "output_ids"], timeout_s=120,
                           engine_key=key))
    return str(err.value)


def _gate_inputs(ids: list[int], lengths: int | None = None) -> dict[str, np.ndarray]:
    """What preprocessing hands spec_gate, and a short max_tokens."""
    return {
        "input_ids": np.array(ids, np.int32),
        "input_lengths": np.array([len(ids) if lengths is None else lengths], np.int32),
        "max_tokens": np.array([4], np.int32),
    }


@pytest.mark.parametrize("model", ["target_engine", "spec_engine"])
def test_an_engine_serves_no_caller_without_the_engine_key(server, model: str) -> None:  # noqa: ANN001
    url = f"localhost:{server.grpc}"
    params = {PARAM_ALGORITHM: "ngram"} if model == "spec_engine" else {}
    arrays = engine_inputs(IDS, 4, 2, streaming=False)
    for key, why in ((None, "missing"), ("not-the-key", "wrong")):
        message = _refused(url, model, arrays, params, key)
        print(f"\n{model} without the key: {message}")
        assert PARAM_ENGINE_KEY in message and why in message and "llm" in message
    served = list(stream_engine(url, model, arrays, params, ["output_ids"], timeout_s=120, engine_key=engine_key()))
    assert served  # with it, the gate's own calls go through


def test_control_messages_without_the_engine_key_are_refused_and_change_nothing(server) -> None:  # noqa: ANN001
    url = f"localhost:{server.grpc}"
    control = engine_inputs([0], 1, 0, streaming=False)
    published = CALIBRATION.read_bytes()
    pin = json.dumps({"draft_ms": {"ngram": 1e6}})  # would route all traffic no_gain if obeyed
    for params in ({PARAM_CALIBRATE: pin}, {PARAM_HAND_OVER: True}, {PARAM_PING: True}, {PARAM_CANCEL: "0123456789abcdef"}):
        assert PARAM_ENGINE_KEY in _refused(url, "spec_engine", control, params), params
    assert CALIBRATION.read_bytes() == published, "a caller without the key changed the calibration the gate reads"


def test_the_gate_answers_the_supervisors_ping_only_with_the_engine_key(server) -> None:  # noqa: ANN001
    """`make serve`'s supervisor pings spec_gate as it pings the engines (specgate_deploy.health): a gate
    whose Python stopped answers none, and its server is restarted (test_orphans stops one)."""
    from specgate_deploy import health

    assert health.unanswered_pings(server.grpc, list(health.PINGED), engine_key()) == []
    assert PARAM_ENGINE_KEY in _refused(f"localhost:{server.grpc}", "spec_gate", health.ping_request("spec_gate")[0], {PARAM_PING: True})
    assert health.unanswered_pings(server.grpc, ["spec_gate"], "not-the-key") == ["spec_gate"]


def test_bad_prompt_ids_are_the_clients_error_and_never_open_the_breaker(server, http) -> None:  # noqa: ANN001
    """Keyless direct calls to spec_gate, routed speculative by header: the org breaker they share
    (failure_threshold 2 in the test policy) must stay closed."""
    url = f"localhost:{server.grpc}"
    before = scrape(server.metrics)
    cases = [([1, 2, VOCAB], None, f"token id {VOCAB} is not in the model's vocabulary"), ([5, -1], None, "token id -1"),
             ([10**6], None, "vocabulary"), (IDS, len(IDS) + 3, "input_lengths")]
    for ids, lengths, needle in cases:
        message = _refused(url, "spec_gate", _gate_inputs(ids, lengths), {HEADER_SPEC_MODE: "prod"})
        print(f"\n{ids}: {message}")
        assert needle in message
    after = scrape(server.metrics)
    for engine in ("speculative", "baseline"):
        assert delta(before, after, "spec_gate_engine_failures_total", engine=engine) == 0, engine
    r = http.generate(ECHO, GenerateParams(max_tokens=8, num_speculative_tokens=4), spec_mode="prod")
    assert (r.meta["route"], r.meta["gate_reason"]) == ("speculative", "prod")  # the shared breaker is closed
