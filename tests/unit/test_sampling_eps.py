"""A tiny positive temperature is greedy, in the gate's request model and in the engines alike (one
constant, contract.SAMPLING_EPS): dividing logits by 1e-40 overflows, and the NaN softmax used to fail
the speculative engine, which counted against the tenant's breaker."""

from __future__ import annotations

import pytest
import torch

from specgate.contract import SAMPLING_EPS
from specgate.decoding.sampling import SamplingParams, sample_token
from specgate.serving.llm_request import parse_llm_request

TINY = [1e-40, 1e-30, SAMPLING_EPS / 2]
LOGITS = torch.tensor([1.0, 30.0, 2.0])


@pytest.mark.parametrize("t", TINY)
def test_request_model_maps_a_tiny_temperature_to_greedy(t: float) -> None:
    assert parse_llm_request({"temperature": t}, max_output_len=16).temperature == 0.0


@pytest.mark.parametrize("t", TINY)
def test_engine_samples_greedily_at_a_tiny_temperature(t: float) -> None:
    params = SamplingParams(temperature=t, seed=0)
    assert params.greedy
    assert sample_token(LOGITS, params, params.generator()) == 1


def test_the_epsilon_itself_samples() -> None:
    assert parse_llm_request({"temperature": SAMPLING_EPS}, max_output_len=16).temperature == SAMPLING_EPS
    params = SamplingParams(temperature=SAMPLING_EPS, seed=0)
    assert not params.greedy
    # finite at the epsilon: (30 - 2) / 1e-5 does not overflow float32
    assert sample_token(LOGITS, params, params.generator()) == 1
