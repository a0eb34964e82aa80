"""The fp32 PyTorch engine for tests: its model and tokenizer as fixtures, and a BatchRunner over it."""

from __future__ import annotations

import threading

import pytest
import torch

from specgate.decoding.batch_runner import BatchRunner
from specgate.decoding.config import EngineConfig
from specgate.decoding.model import load_llama
from specgate.decoding.request import Event, GenerationRequest
from specgate.decoding.torch_target import TorchTarget


@pytest.fixture(scope="module")
def tok(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_llama(checkpoint, torch.float32, 1024)


def chat_ids(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def torch_runner(checkpoint, model, max_context: int = 1024, max_batch_size: int = 8, **cfg) -> BatchRunner:  # noqa: ANN001
    """A BatchRunner on the fp32 PyTorch reference `model`."""
    config = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=max_context, max_batch_size=max_batch_size, **cfg)
    return BatchRunner(TorchTarget(model, max_context, max_batch_size), config)


def run_all(runner: BatchRunner, reqs: list[GenerationRequest]) -> list[list[int]]:
    """Submit all at once (so they share batches) and wait for every final event."""
    outs: list[list[int]] = [[] for _ in reqs]
    done = [threading.Event() for _ in reqs]
    errors: list[str] = []

    def emit_for(i: int):
        def emit(ev: Event) -> None:
            outs[i].extend(ev.tokens)
            if ev.error:
                errors.append(ev.error)
            if ev.finished:
                done[i].set()
        return emit

    for i, r in enumerate(reqs):
        runner.submit(r, emit_for(i))
    for d in done:
        assert d.wait(600), "request never finished"
    assert not errors, errors
    return outs
