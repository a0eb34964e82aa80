"""A smaller causal LM with the target's tokenizer drafts a chain, one token per forward.

The draft model is itself a `Target` (llama.cpp over a draft GGUF, or the PyTorch engine over a
draft checkpoint), so any draft that shares the target's vocabulary plugs in.
"""

from __future__ import annotations

import time

import torch

from specgate.decoding.sampling import SamplingParams, draw, greedy_tokens, warp
from specgate.decoding.target import Target
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter

SLOT = 0
# Tokens a drafted step leaves for the next `propose` to feed the draft: the bonus token, and the last
# accepted draft, which the draft never ran. More is a catch-up (the prompt, plain steps).
STEP_FEED = 2


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, draft: Target, vocab_size: int) -> None:
        if draft.info.vocab_size != vocab_size:
            raise ValueError(f"draft vocab {draft.info.vocab_size} != target vocab {vocab_size}")
        self.draft = draft

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        super().begin(prompt_ids, params, gen)
        self.draft.release(SLOT)

    def backlog(self, tokens: list[int], features: int) -> int:
        return len(tokens) - self.draft.length(SLOT)

    def propose(self, tokens: list[int], features: torch.Tensor, k: int) -> DraftTree:
        # everything the draft has not seen yet, ending with the root
        start, unseen = time.perf_counter(), tokens[self.draft.length(SLOT) :]
        logits, _ = self.draft.extend(SLOT, unseen, features=False)
        # A first draft after a 600-token prompt prefills it in the draft: priced per node, that one
        # extend would make the draft model look too dear to ever draft again (as EAGLE's catch-up did).
        self.catchup_ms = 1000 * (time.perf_counter() - start) if len(unseen) > STEP_FEED else 0.0
        self.base = len(tokens)
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if self.params.greedy:
                tok = greedy_tokens(logits)[0]
            else:
                qs.append(warp(logits, self.params))
                tok = draw(qs[-1], self.gen)
            drafted.append(tok)
            if i + 1 < k:
                logits = self.draft.forward([(SLOT, [tok])])[0]
        return DraftTree.chain(drafted, torch.stack(qs) if qs else None)

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        # Drafts past the accepted ones are stale: the draft's cache keeps tokens up to the last accepted.
        self.draft.truncate(SLOT, self.base + len(path))
