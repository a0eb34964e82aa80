"""Issue 49: every model bounds what a request may make it do, before the work it would cost, and says
which field is at fault (INVALID_ARG; HTTP 400). Stop lists: every stop is checked at every token on
the batch's one decode thread, where about 100k short ones added ~5 ms to every batched sequence's
step. Prompts: the gate hashed every token id before it checked their number. (The front's and
preprocessing's bounds: test_front.py, test_tokenizer.py and tests/integration/test_serving.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.unit import fake_pb_utils as pb

pb.install()

from specgate.contract import MAX_STOP_TOKENS, MAX_STOP_WORDS  # noqa: E402
from specgate.decoding.config import EngineConfig  # noqa: E402
from specgate.errors import InvalidInput  # noqa: E402
from specgate.serving import gate_parsing  # noqa: E402
from specgate.serving.engine_model import parse_engine_request  # noqa: E402
from specgate.serving.gate_model import GateModel  # noqa: E402
from specgate.text.stop_words import stop_words_list  # noqa: E402


class Request:
    def __init__(self, **arrays: np.ndarray) -> None:
        self.inputs = [pb.Tensor(name, arr) for name, arr in arrays.items()]
        self.sender = pb.ResponseSender()

    def parameters(self) -> str:
        return json.dumps({})

    def request_id(self) -> str:
        return ""

    def get_response_sender(self) -> pb.ResponseSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return ["output_ids"]


TOO_MANY = [[5, i] for i in range(MAX_STOP_WORDS + 1)]
TOO_LONG = [[5] * (MAX_STOP_TOKENS + 1)]


@pytest.mark.parametrize("words, needle", [(TOO_MANY, f"at most {MAX_STOP_WORDS}"), (TOO_LONG, f"at most {MAX_STOP_TOKENS}")])
def test_the_gate_and_the_engines_refuse_stop_lists_past_the_bounds(words: list[list[int]], needle: str) -> None:
    ids = np.array([1, 2, 3], np.int32)
    bad = stop_words_list(words)
    with pytest.raises(InvalidInput, match=f"stop_words_list: .*{needle}"):
        gate_parsing.stop_words(Request(input_ids=ids, stop_words_list=bad))
    engine = Request(input_ids=ids, request_output_len=np.array([4], np.int32), stop_words_list=bad)
    with pytest.raises(InvalidInput, match=f"stop_words_list: .*{needle}"):
        parse_engine_request(engine, EngineConfig(backend="torch", model="unused"))
    within = stop_words_list(words[:MAX_STOP_WORDS] if words is TOO_MANY else [words[0][:MAX_STOP_TOKENS]])
    assert gate_parsing.stop_words(Request(input_ids=ids, stop_words_list=within)) is not None


def test_the_gate_checks_a_prompt_s_size_before_it_reads_its_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    digested: list[int] = []
    monkeypatch.setattr(gate_parsing, "content_digest", lambda prompt, fields: digested.append(len(prompt)) or "")
    gm = GateModel.__new__(GateModel)
    gm.max_output_len, gm.max_input_len, gm.vocab_size = 16, 8, 100
    request = Request(input_ids=np.ones(1_000_000, np.int32))
    gm.execute([request])
    ((response, _),) = request.sender.sent
    assert response.has_error() and "at most 8 fit the context" in response.error().message()
    assert digested == []
