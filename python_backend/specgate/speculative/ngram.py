"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

from torch import Tensor

from specgate.engine.tree import DraftTree
from specgate.speculative.drafter import Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        # Longest n first: a longer matched suffix predicts the continuation better.
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            # latest match first (recent text is the better predictor); the tail itself is excluded
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    cont = tokens[start + n : start + n + k]
                    return DraftTree.chain(cont)
        return DraftTree.empty()
