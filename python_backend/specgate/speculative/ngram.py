"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

import torch
from torch import Tensor

from specgate.decoding.sampling import SamplingParams
from specgate.decoding.tree import DraftTree
from specgate.speculative.drafter import Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        super().begin(prompt_ids, params, gen)
        # Every n-gram (min_n..max_n tokens) that ends before the last token -> its latest start.
        # Kept up to date as tokens grow (they only grow within a request), so a lookup costs the
        # same at any context length; a scan of the whole context each step was a measurable part
        # of a llama.cpp decode step (docs/engines.md, "Calibration").
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < this are in _latest
        self._memo: tuple[int, tuple[int, int]] = (-1, (0, 0))  # (len(tokens), match)

    def context(self, tokens: list[int]) -> int:
        """The length of the matched suffix (0: no match): a longer one predicts far better."""
        return self._match(tokens)[0]

    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        n, start = self._match(tokens)
        return DraftTree.chain(tokens[start + n : start + n + k]) if n else DraftTree.empty()

    def _match(self, tokens: list[int]) -> tuple[int, int]:
        """(n, start) of the longest suffix of up to max_n tokens seen before, latest occurrence
        (recent text is the better predictor; the suffix itself is excluded); (0, 0) if none."""
        if self._memo[0] == len(tokens):  # context() then propose() on the same tokens
            return self._memo[1]
        for end in range(self._indexed, len(tokens) - 1):  # n-grams ending before the last token
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._latest[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self._indexed = max(self._indexed, len(tokens) - 1)
        found = (0, 0)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(tokens[-n:]))
            if start is not None:
                found = (n, start)
                break
        self._memo = (len(tokens), found)
        return found
