"""EAGLE-1 (chain): a one-layer head drafts from the target's own features, autoregressively.

Head pairing: cache entry t holds (target feature at position t, token at position t+1); its output
is the predicted feature at position t+1, whose draft logits predict the token after it. After each
verification the head's draft entries are dropped and the real target features of the newly
committed positions are fed instead, so `accept` has nothing to roll back.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from specgate.decoding.sampling import SamplingParams, draw, warp
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle_head import EagleHead
from specgate.speculative.eagle_kernel import KernelEagleHead


class EagleBase(Drafter):
    """Feeds committed (feature, next token) pairs to the head; shared by the chain and the tree."""

    uses_features = True

    def __init__(self, head: EagleHead | KernelEagleHead, vocab_size: int, max_len: int) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.cache = head.new_cache(max_len, head.dtype)

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        super().begin(prompt_ids, params, gen)
        self.cached = 0  # committed pairs in the head's cache
        self._step_feed = 0  # pairs a drafted step can commit: its nodes and the bonus token

    def _consume(self, tokens: list[int], features: Tensor, k: int) -> Tensor:
        """Append the new committed pairs; return the predicted feature at the root's position [1, 1, D].

        More pairs than the last drafted step could commit are a catch-up (the prompt, plain steps):
        its time is `catchup_ms`. A first draft after a prompt of 369 tokens took 16 ms here, which
        priced per node kept EAGLE from ever drafting again."""
        start = time.perf_counter()
        n = features.shape[0]
        ids = torch.tensor([tokens[len(tokens) - n :]])
        out = self.head(features.unsqueeze(0), ids, self.cache, self.cached)
        self.cached += n
        self.catchup_ms = 1000 * (time.perf_counter() - start) if n > self._step_feed else 0.0
        self._step_feed = k + 1
        return out[:, -1:]

    def _to_target(self, draft_probs: Tensor) -> Tensor:
        """A distribution over the draft vocabulary, placed on the target vocabulary."""
        q = draft_probs.new_zeros(self.vocab_size)
        return q.index_copy_(0, self.head.d2t, draft_probs)


class EagleDrafter(EagleBase):
    name = "eagle"

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        feat = self._consume(tokens, features, k)
        drafted: list[int] = []
        qs: list[Tensor] = []
        for i in range(k):
            logits = self.head.draft_logits(feat[0, -1])
            if self.params.greedy:
                tok = self.head.draft_token(logits)
            else:
                qs.append(self._to_target(warp(logits, self.params)))
                tok = draw(qs[-1], self.gen)
            drafted.append(tok)
            if i + 1 < k:  # the head's entry for draft i sits right after the committed pairs
                feat = self.head(feat, torch.tensor([[tok]]), self.cache, self.cached + i)
        return DraftTree.chain(drafted, torch.stack(qs) if qs else None)
