"""A smaller causal LM with the target's tokenizer drafts a chain, one token per forward."""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.engine.model import KVCache, Llama
from specgate.engine.sampling import SamplingParams, warp
from specgate.speculative.drafter import Drafter, DraftTree


class DraftModelDrafter(Drafter):
    name = "draft_model"
    default_k = 3  # build/bench_drafters.py: the derived CPU draft accepts little, so short chains lose least
    max_k = 16

    def __init__(self, model: Llama, target: Llama, max_len: int) -> None:
        if model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"draft vocab {model.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
        self.model = model
        self.cache = KVCache(model.cfg, 1, max_len, model.embed.weight.dtype)
        self.slot = torch.zeros(1, dtype=torch.long)

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        super().begin(prompt_ids, params, gen)
        self.cached = 0  # tokens[:cached] have K/V in our cache

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        self.base = len(tokens)
        ids = torch.tensor([tokens[self.cached :]])  # everything not yet seen, ending with the root
        drafted: list[int] = []
        qs: list[Tensor] = []
        for i in range(k):
            hidden = self.model(ids, self.cache, self.slot, torch.tensor([self.cached]))
            self.cached += ids.shape[1]
            logits = self.model.logits(hidden[0, -1])
            if self.params.greedy:
                tok = int(logits.argmax())
            else:
                qs.append(warp(logits, self.params))
                tok = int(torch.multinomial(qs[-1], 1, generator=self.gen))
            drafted.append(tok)
            ids = torch.tensor([[tok]])
        return DraftTree.chain(drafted, torch.stack(qs) if qs else None)

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        # Cached drafts past the accepted ones are stale; the next write overwrites them.
        self.cached = min(self.cached, self.base + len(path))
