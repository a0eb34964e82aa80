"""Building the drafters an engine has, from its config (limits and defaults: specgate.algorithms)."""

from __future__ import annotations

import torch

from specgate.decoding.config import EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.target import Target
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import int8_supported, load_eagle_head
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter


def build_drafters(target: Target, cfg: EngineConfig) -> dict[str, Drafter]:
    """Every drafter whose weights the config names (n-gram needs none)."""
    vocab, max_len = target.info.vocab_size, target.info.max_context
    drafters: list[Drafter] = [NgramDrafter()]
    if cfg.draft_model is not None:
        drafters.append(DraftModelDrafter(load_target(cfg, cfg.draft_model, num_slots=1), vocab))
    if cfg.eagle_head_dir is not None:
        embed, lm_head = target.embeddings()
        int8 = cfg.eagle_head_dtype == "int8" or (cfg.eagle_head_dtype == "auto" and int8_supported())
        dtype = cfg.torch_dtype if cfg.eagle_head_dtype in ("auto", "int8") else getattr(torch, cfg.eagle_head_dtype)
        head = load_eagle_head(cfg.eagle_head_dir, embed, lm_head, dtype, int8=int8)
        drafters += [
            EagleDrafter(head, vocab, max_len),
            Eagle2Drafter(head, vocab, max_len),
            HybridDrafter(Eagle2Drafter(head, vocab, max_len), NgramDrafter()),
        ]
    return {d.name: d for d in drafters}
