"""Algorithm names a request may ask for, their k limits, and building the drafters an engine has."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from specgate.engine.model import Llama, load_llama
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import load_eagle_head
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter

ALGORITHMS: dict[str, type[Drafter]] = {
    cls.name: cls for cls in (EagleDrafter, Eagle2Drafter, HybridDrafter, DraftModelDrafter, NgramDrafter)
}


def check_request(algorithm: str, k: int | None, available: Mapping[str, Drafter]) -> int:
    """The k to use; ValueError for an unknown or unloaded algorithm or a k out of range."""
    cls = ALGORITHMS.get(algorithm)
    if cls is None:
        raise ValueError(f"unknown speculative algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if algorithm not in available:
        raise ValueError(f"speculative algorithm {algorithm!r} is not loaded in this engine; loaded: {sorted(available)}")
    if k is None:
        return cls.default_k
    if not 1 <= k <= cls.max_k:
        raise ValueError(f"num_speculative_tokens for {algorithm!r} must be in [1, {cls.max_k}], got {k}")
    return k


def build_drafters(
    target: Llama,
    max_len: int,
    draft_model_dir: Path | None = None,
    eagle_head_dir: Path | None = None,
) -> dict[str, Drafter]:
    """Every drafter whose weights are given (n-gram needs none), on the target's dtype."""
    dtype = target.embed.weight.dtype
    drafters: list[Drafter] = [NgramDrafter()]
    if draft_model_dir is not None:
        drafters.append(DraftModelDrafter(load_llama(draft_model_dir, dtype, max_len), target, max_len))
    if eagle_head_dir is not None:
        head = load_eagle_head(eagle_head_dir, target, dtype)
        drafters += [
            EagleDrafter(head, target, max_len),
            Eagle2Drafter(head, target, max_len),
            HybridDrafter(Eagle2Drafter(head, target, max_len), NgramDrafter()),
        ]
    return {d.name: d for d in drafters}
