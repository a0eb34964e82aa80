"""`Target` over the PyTorch Llama (decoding/model.py): the exact reference engine (fp32 by default).

Sequences keep their cache rows packed in physical slots 0..n-1 (a released sequence's hole is
filled by moving the last one), so a batched decode step reads the cache through a view instead of
gathering it: a copy per layer per step otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specgate.decoding.model import KVCache, Llama, load_llama
from specgate.decoding.target import Target, TargetInfo
from specgate.decoding.tree import DraftTree


class TorchTarget(Target):
    def __init__(self, model: Llama, max_context: int, num_slots: int) -> None:
        self.model = model
        self.cache = KVCache(model.cfg, num_slots, max_context, model.embed.weight.dtype)
        self.info = TargetInfo(
            backend="torch",
            dtype=str(model.embed.weight.dtype).removeprefix("torch."),
            threads=torch.get_num_threads(),
            vocab_size=model.cfg.vocab_size,
            hidden_size=model.cfg.hidden_size,
            eos_token_id=model.cfg.eos_token_id,
            max_context=max_context,
            num_slots=num_slots,
        )
        self._phys: dict[int, int] = {}  # slot -> physical cache row
        self._len: dict[int, int] = {}
        self._pending = 0  # rows written by the last `verify`, not yet committed

    @classmethod
    def load(cls, checkpoint_dir: Path, dtype: torch.dtype, max_context: int, num_slots: int) -> "TorchTarget":
        return cls(load_llama(checkpoint_dir, dtype, max_context), max_context, num_slots)

    def _row(self, slot: int) -> int:
        if slot not in self._phys:
            self._phys[slot] = len(self._phys)
            self._len[slot] = 0
        return self._phys[slot]

    def _run(self, slot: int, ids: list[int], positions: Tensor | None = None, tree_mask: Tensor | None = None) -> Tensor:
        row = self._row(slot)
        return self.model(
            torch.tensor([ids]), self.cache, torch.tensor([row]), torch.tensor([self._len[slot]]), positions, tree_mask
        )[0]

    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        start = time.perf_counter()
        logits = self._forward(items)
        if self.on_decode is not None:
            self.on_decode((sum(len(t) for _, t in items), len(items)), start, time.perf_counter())
        return logits.numpy()

    def _forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        out: list[Tensor | None] = [None] * len(items)
        singles = []
        for i, (slot, tokens) in enumerate(items):
            if len(tokens) == 1:
                singles.append(i)
                continue
            hidden = self._run(slot, list(tokens))
            self._len[slot] += len(tokens)
            out[i] = self.model.logits(hidden[-1])
        if singles:  # one batched decode step, rows in physical order so the cache is read as a view
            singles.sort(key=lambda i: self._row(items[i][0]))
            slots = [items[i][0] for i in singles]
            ids = torch.tensor([[items[i][1][0]] for i in singles])
            rows = torch.tensor([self._phys[s] for s in slots])
            lens = torch.tensor([self._len[s] for s in slots])
            logits = self.model.logits(self.model(ids, self.cache, rows, lens))[:, -1]
            for j, i in enumerate(singles):
                self._len[slots[j]] += 1
                out[i] = logits[j]
        return torch.stack(out)  # type: ignore[arg-type]

    def extend(self, slot: int, tokens: Sequence[int], features: bool) -> tuple[np.ndarray, Tensor | None]:
        hidden = self._run(slot, list(tokens))
        self._len[slot] += len(tokens)
        return self.model.logits(hidden[-1]).numpy(), hidden if features else None

    def verify(self, slot: int, root: int, tree: DraftTree, features: bool) -> tuple[np.ndarray, Tensor | None]:
        # A chain is the model's default (causal mask, consecutive positions): its cheaper path.
        chain = tree.is_chain
        start = self._len[slot]
        began = time.perf_counter()
        hidden = self._run(
            slot,
            [root, *tree.tokens.tolist()],
            positions=None if chain else tree.positions(start).unsqueeze(0),
            tree_mask=None if chain else tree.attention_mask(),
        )
        self._pending = 1 + len(tree)
        logits = self.model.logits(hidden)
        ended = time.perf_counter()
        self.last_verify_ms = 1000 * (ended - began)
        if self.on_decode is not None:
            self.on_decode((1 + len(tree), chain, features), began, ended)
        return logits.numpy(), hidden if features else None

    def commit(self, slot: int, keep: Sequence[int]) -> None:
        if not keep or keep[0] != 0 or max(keep) >= self._pending:
            raise ValueError(f"commit keeps rows {list(keep)} of the {self._pending} just verified (root first)")
        self.cache.compact(self._phys[slot], self._len[slot], torch.tensor(list(keep)))
        self._len[slot] += len(keep)
        self._pending = 0

    def truncate(self, slot: int, length: int) -> None:
        self._len[slot] = min(self._len.get(slot, 0), length)  # later writes overwrite the rest

    def release(self, slot: int) -> None:
        row = self._phys.pop(slot, None)
        self._len.pop(slot, None)
        if row is None:
            return
        last = max(self._phys.items(), key=lambda kv: kv[1], default=None)
        if last is not None and last[1] > row:  # fill the hole: keep rows packed at 0..n-1
            self.cache.move(last[1], row, self._len[last[0]])
            self._phys[last[0]] = row

    def length(self, slot: int) -> int:
        return self._len.get(slot, 0)

    def embeddings(self) -> tuple[Tensor, Tensor]:
        return self.model.embed.weight.float(), self.model.lm_head.weight.float()
