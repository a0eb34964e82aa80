"""The spec engine's drafters load from what `make build-engines` and the repo provide."""

from __future__ import annotations

import pytest
import torch

from specgate.contract import EAGLE_HEAD_ALGORITHMS, SPEC_ALGORITHMS
from specgate.engine.model import load_llama
from specgate.speculative.registry import ALGORITHMS, build_drafters, check_request
from tests.conftest import DRAFT, HEAD


def test_every_algorithm_loads_from_shipped_artifacts(checkpoint):
    assert (HEAD / "eagle_head.safetensors").exists(), "the shipped EAGLE head is missing"
    assert DRAFT.exists(), "no draft model: run `make build-engines`"
    target = load_llama(checkpoint, torch.bfloat16, 256)
    drafters = build_drafters(target, 256, DRAFT, HEAD)
    assert set(drafters) == set(ALGORITHMS) == set(SPEC_ALGORITHMS)  # the gate accepts what the engine has
    for name in ALGORITHMS:
        assert check_request(name, None, drafters) == ALGORITHMS[name].default_k
    without_head = build_drafters(target, 256, DRAFT, None)
    assert set(SPEC_ALGORITHMS) - set(without_head) == set(EAGLE_HEAD_ALGORITHMS)  # what the benches skip


def test_unknown_or_unloaded_algorithm_is_refused(checkpoint):
    target = load_llama(checkpoint, torch.bfloat16, 64)
    only_ngram = build_drafters(target, 64)
    with pytest.raises(ValueError, match="unknown"):
        check_request("medusa", None, only_ngram)
    with pytest.raises(ValueError, match="not loaded"):
        check_request("eagle", None, only_ngram)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        check_request("ngram", 99, only_ngram)
