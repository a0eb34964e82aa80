"""The spec engine's drafters load from what `make build-engines` and the repo provide."""

from __future__ import annotations

import pytest
import torch

from specgate.algorithms import ALGORITHMS, EAGLE_HEAD_ALGORITHMS, SPEC_ALGORITHMS, check_k
from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.registry import build_drafters
from tests.conftest import DRAFT_GGUF, HEAD


def test_every_algorithm_loads_from_shipped_artifacts(gguf):
    assert (HEAD / "eagle_head.safetensors").exists(), "the shipped EAGLE head is missing"
    assert DRAFT_GGUF.exists(), "no draft GGUF: run `make build-engines`"
    cfg = EngineConfig(model=gguf, draft_model=DRAFT_GGUF, eagle_head_dir=HEAD, max_context=256)
    target = load_target(cfg, gguf, num_slots=1, tree_nodes=16)
    drafters = build_drafters(target, cfg)
    assert set(drafters) == set(ALGORITHMS) == set(SPEC_ALGORITHMS)  # the gate accepts what the engine has
    without_head = build_drafters(target, cfg.model_copy(update={"eagle_head_dir": None}))
    assert set(SPEC_ALGORITHMS) - set(without_head) == set(EAGLE_HEAD_ALGORITHMS)  # what the benches skip


def test_unknown_unloaded_or_out_of_range_is_refused(gguf):
    cfg = EngineConfig(model=gguf, max_context=64)
    target = load_target(cfg, gguf, num_slots=1)
    gen = SpeculativeGenerator(target, build_drafters(target, cfg))  # n-gram only
    with pytest.raises(ValueError, match="unknown"):
        gen.generate([1, 2], 4, algorithm="medusa")
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        gen.generate([1, 2], 4, algorithm="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        gen.generate([1, 2], 4, algorithm="ngram", k=99)
    for name, spec in ALGORITHMS.items():
        assert check_k(name, None) == spec.default_k and check_k(name, spec.max_k) == spec.max_k


def test_eagle_head_weights_follow_the_config(gguf):
    """auto = the fused llama.cpp kernel (the patched build has it); int8 = PyTorch's int8 products where
    torch has x86's int8 kernels; a named float dtype keeps float weights; the kernel needs llama.cpp."""
    from specgate.speculative.eagle_kernel import KernelEagleHead

    cfg = EngineConfig(model=gguf, eagle_head_dir=HEAD, max_context=64)
    target = load_target(cfg, gguf, num_slots=1)
    for dtype in ("auto", "kernel"):
        drafters = build_drafters(target, cfg.model_copy(update={"eagle_head_dtype": dtype}))
        assert all(isinstance(drafters[name].head, KernelEagleHead) for name in ("eagle", "eagle2")), dtype
    for dtype, int8 in (("int8", True), ("float32", False), ("bfloat16", False)):
        head = build_drafters(target, cfg.model_copy(update={"eagle_head_dtype": dtype}))["eagle"].head
        quantized = not isinstance(head.lm_head, torch.nn.Linear)
        assert quantized == int8, dtype
        assert head.dtype == (torch.float32 if int8 else getattr(torch, dtype))
    with pytest.raises(ValueError, match="needs backend 'llamacpp'"):
        build_drafters(target, cfg.model_copy(update={"eagle_head_dtype": "kernel", "backend": "torch"}))
