"""The target model behind both runners: a causal LM with a KV cache of `num_slots` sequences.

Two implementations speak this interface:
- `LlamaCppTarget` (decoding/llamacpp_target.py): llama.cpp over the GGUF, the CPU default;
- `TorchTarget` (decoding/torch_target.py): the PyTorch engine, the exact fp32 reference.

The batching runner calls `forward` (each sequence's next token, or a prompt chunk); the speculative
generator calls `prefill`, `verify` (root + a draft tree in one pass) and `commit` (keep the accepted
path); a draft model runs as a second target through `extend` and `truncate`. Logits come back as
float32 NumPy arrays and hidden states as float32 torch tensors, on the CPU, so sampling and
verification are the same code for both. Why NumPy: llama.cpp's logits start there, and a greedy
token needs only NumPy's argmax; the torch tensor's round trip after each decode (`from_numpy`, a
row, `.numpy()`) was 0.12 ms of the 0.3-0.4 ms of Python between two plain decodes on a 2-core
EPYC, its caches cold after the decode (docs/engines.md, "Threads"). Sampling reads the rows as
tensors without a copy (`torch.as_tensor`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from specgate.decoding.tree import DraftTree


@dataclass(frozen=True)
class TargetInfo:
    backend: str  # "llamacpp" | "torch"
    dtype: str  # what the weights compute in, e.g. "Q4_1" or "float32"
    threads: int
    vocab_size: int
    hidden_size: int
    eos_token_id: int
    max_context: int  # tokens per sequence, draft tree included
    num_slots: int


class Target(ABC):
    info: TargetInfo
    # Milliseconds of compute in the last `verify` (waiting for the machine's compute lock excluded):
    # what the speculative engine's live cost curve learns from (goodput.LiveCurve).
    last_verify_ms: float = 0.0
    # Told of every decode where set: its shape, and its perf_counter start and end. How a served
    # engine measures what a streamed response costs its decode (cost_model/stream_pacer.py).
    on_decode: Callable[[Hashable, float, float], None] | None = None

    @abstractmethod
    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        """Append each item's tokens to its slot's cache; logits [len(items), V] after each item's last token."""

    @abstractmethod
    def extend(self, slot: int, tokens: Sequence[int], features: bool) -> tuple[np.ndarray, Tensor | None]:
        """Append `tokens` (any number) to the slot: (logits after the last one [V], hidden states [T, D] if asked)."""

    def prefill(self, slot: int, tokens: Sequence[int], features: bool) -> tuple[np.ndarray, Tensor | None]:
        """Start `slot` afresh from `tokens` (see `extend`)."""
        self.release(slot)
        return self.extend(slot, tokens, features)

    @abstractmethod
    def verify(self, slot: int, root: int, tree: DraftTree, features: bool) -> tuple[np.ndarray, Tensor | None]:
        """Run the root and the tree's nodes in one pass, each node seeing only its ancestors.

        Returns logits [1+N, V] and, if asked, hidden states [1+N, D] for (root, nodes). The cache
        holds all of them until `commit` keeps the accepted ones.
        """

    @abstractmethod
    def commit(self, slot: int, keep: Sequence[int]) -> None:
        """After `verify`: keep rows `keep` (0 = the root, then accepted nodes, a root-to-leaf path)."""

    @abstractmethod
    def truncate(self, slot: int, length: int) -> None:
        """Drop the slot's cached tokens from `length` on (a draft model rolls back rejected drafts)."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """Forget the slot's sequence; the slot can start a new one."""

    @abstractmethod
    def length(self, slot: int) -> int:
        """Tokens cached for the slot."""

    def cached_tokens(self) -> int:
        """Tokens cached over all slots: 0 once every sequence is released (engines export it)."""
        return sum(self.length(slot) for slot in range(self.info.num_slots))

    @abstractmethod
    def embeddings(self) -> tuple[Tensor, Tensor]:
        """(input embedding table [V, D], output projection [V, D]) as float32: the EAGLE head shares them."""
