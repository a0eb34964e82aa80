"""The drafter interface. Every drafter returns a `DraftTree` (decoding/tree.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from specgate.decoding.sampling import SamplingParams
from specgate.decoding.tree import DraftTree


class Drafter(ABC):
    """Proposes draft tokens after the last accepted token; one request at a time.

    Lifecycle per request: `begin`, then per step `propose` -> (target verifies) -> `accept`.
    `tokens` passed to `propose` are all committed tokens (prompt + output); the last one is the root,
    which the target has not run yet. `features` are the target's final hidden states [F, D] for the
    F positions committed since the previous `propose` (excluding the root): drafters that read
    features (EAGLE) consume them, the others ignore them.
    """

    name: ClassVar[str]
    uses_features: ClassVar[bool] = False  # reads the target's hidden states (EAGLE)
    # The part of the last `propose` spent catching up on context from steps it did not draft (the
    # prompt, plain steps): paid once for all of them, so the engine does not price nodes with it
    # but per unit of `backlog`.
    catchup_ms: float = 0.0

    def begin(self, prompt_ids: list[int], params: SamplingParams, gen: torch.Generator) -> None:
        """Reset per-request state. Sampling drafters draw with `params` and `gen`."""
        self.params, self.gen = params, gen

    def backlog(self, tokens: list[int], features: int) -> int:
        """What the next `propose` would catch up on before drafting, in units its catch-up is priced
        by: the `features` target features not yet consumed, for a drafter that reads them."""
        return features if self.uses_features else 0

    def context(self, tokens: list[int]) -> int:
        """A class of the coming draft whose acceptance the engine tracks apart (0: one class).
        Asked before the budget is chosen, so it must be cheap."""
        return 0

    @abstractmethod
    def propose(self, tokens: list[int], features: Tensor, k: int) -> DraftTree:
        """Draft at most `k` nodes rooted at `tokens[-1]`."""

    def accept(self, tree: DraftTree, path: list[int]) -> None:
        """`path` = accepted node indices, root to leaf. Stateful drafters roll their caches back."""
