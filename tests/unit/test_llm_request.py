"""Validation of the entry point's knobs: each bad value gets a message naming the input."""

import pytest

from specgate.errors import InvalidInput
from specgate.serving.llm_request import parse_llm_request


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),  # a float32 overflow (1e39 in JSON)
        ({"api_key": 5}, "x-api-key: Input should be a valid string"),  # a JSON number as the key
        ({"spec_header": ["prod"]}, "x-speculative-decoding: "),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"speculative_algorithm": "medusa"}, "speculative_algorithm"),
    ],
)
def test_rejects_with_named_input(fields, needle):
    with pytest.raises(InvalidInput, match=needle):
        parse_llm_request(fields, max_output_len=1024)


def test_defaults_and_valid():
    r = parse_llm_request({"max_tokens": 1024, "temperature": 0.7, "top_p": 1.0, "seed": 3}, max_output_len=1024)
    assert (r.max_tokens, r.temperature, r.seed, r.stream) == (1024, 0.7, 3, False)
