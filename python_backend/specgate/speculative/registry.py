"""Building the drafters an engine has, from its config (limits and defaults: specgate.algorithms)."""

from __future__ import annotations

from pathlib import Path

import torch

from specgate.decoding.config import EngineConfig
from specgate.decoding.llamacpp_native import native
from specgate.decoding.loading import load_target
from specgate.decoding.target import Target
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import EagleHead, int8_supported, load_eagle_head
from specgate.speculative.eagle_kernel import KernelEagleHead, KernelFunctions
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter


def build_drafters(target: Target, cfg: EngineConfig) -> dict[str, Drafter]:
    """Every drafter whose weights the config names (n-gram needs none)."""
    vocab, max_len = target.info.vocab_size, target.info.max_context
    drafters: list[Drafter] = [NgramDrafter()]
    if cfg.draft_model is not None:
        drafters.append(DraftModelDrafter(load_target(cfg, cfg.draft_model, num_slots=1), vocab))
    if cfg.eagle_head_dir is not None:
        head = _eagle_head(target, cfg, cfg.eagle_head_dir)
        drafters += [
            EagleDrafter(head, vocab, max_len),
            Eagle2Drafter(head, vocab, max_len),
            HybridDrafter(Eagle2Drafter(head, vocab, max_len), NgramDrafter()),
        ]
    return {d.name: d for d in drafters}


def _eagle_head(target: Target, cfg: EngineConfig, path: Path) -> EagleHead | KernelEagleHead:
    """The head as `cfg.eagle_head_dtype` asks (config.py): the fused kernel, PyTorch int8, or a float dtype."""
    embed, lm_head = target.embeddings()
    kernel = KernelFunctions(native().cpu_function) if cfg.backend == "llamacpp" else None
    if cfg.eagle_head_dtype == "kernel" or (cfg.eagle_head_dtype == "auto" and kernel is not None and kernel.available):
        if kernel is None:
            raise ValueError("eagle_head_dtype 'kernel' is llama.cpp's: it needs backend 'llamacpp'")
        head = load_eagle_head(path, embed, lm_head, torch.float32)
        return KernelEagleHead(head, kernel, target.info.max_context, threads=cfg.threads)
    int8 = cfg.eagle_head_dtype == "int8" or (cfg.eagle_head_dtype == "auto" and int8_supported())
    dtype = cfg.torch_dtype if cfg.eagle_head_dtype in ("auto", "int8") else getattr(torch, cfg.eagle_head_dtype)
    return load_eagle_head(path, embed, lm_head, dtype, int8=int8)
