"""`Target` over llama.cpp (llama-cpp-python's low-level API) and a GGUF file: the CPU default.

llama.cpp brings the quantized kernels the GGUF was made for, and one decode can hold tokens of
many sequences. Each slot is a llama.cpp sequence id.

- Baseline (no trees): one stream of `max_context` cells per sequence (`kv_unified` off), so a
  token attends over its own sequence only. One decode holds every running sequence's next token
  and the prompt chunks of sequences that join.
- Speculative (`tree_nodes > 0`): one unified cache. A draft tree is verified in one decode by
  giving every root-to-leaf branch its own sequence id: a token belongs to the sequences of all
  branches through it, and llama.cpp lets a token see a cached cell only if the cell carries the
  token's (first) sequence id and an equal or lower position. With the prefix copied into every
  branch sequence and nodes at position `root + depth`, each node sees exactly its ancestors.
  `commit` keeps the accepted branch up to the accepted depth and removes the rest.

Features for EAGLE are the per-token hidden states after the final norm, which llama.cpp returns
next to the logits when embeddings are on (pooling none). With embeddings on, llama.cpp outputs
every token of a decode, so they are switched on only for decodes whose features are wanted.

Exact mode (`exact=True`): a token's logits are bit-identical whatever the decode holds (one
token, a verified tree, the tokens of other sequences). It turns on the patched ggml's
batch-invariant kernels for this target's decodes (build/llamacpp_patch.py) and keeps the cache's
cells in position order: a tree whose accepted path is not its first children leaves holes that
later tokens would fill out of order, so the accepted tokens past the first hole are dropped from
the cache and decoded again at the front of the next decode (docs/engines.md, "Exact greedy").
Repacked weights (ggml's AMX and CPU-repack buffers) have one kernel for one row and another for
many; some reduce a row the same way in both (AMX's, for Q4_0/Q4_1/Q8_0), others may not. So an
exact target loads them and keeps them only if a probe of its own model finds every batch size it
tries bit-identical to one-token decodes; otherwise it loads the file's layout, where the patch's
kernels are invariant by construction (`repacked` says which it kept).

Decodes run on a persistent ggml thread pool whose idle workers sleep at once (poll 0): between
decodes the cores belong to the rest of the server (docs/engines.md, "Threads").
"""

from __future__ import annotations

import ctypes
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from specgate.decoding.compute_lock import compute_lock
from specgate.decoding.llamacpp_native import native, quiet_logs
from specgate.decoding.target import Target, TargetInfo
from specgate.decoding.tree import DraftTree

log = logging.getLogger(__name__)

N_BATCH = 512  # tokens per decode call; longer prompts are fed in chunks
POLL = 0  # how long the pool's idle workers spin after a decode (0..100): not at all
# Batch sizes the exactness probe decodes at once, against one token at a time: each side of the
# kernels' 16-token tiles, and past AMX's 32-row blocks.
PROBE_SIZES = (2, 3, 8, 17, 33)


def _llama_cpp():  # imported lazily: the torch engine and the gate never need it
    import llama_cpp

    return llama_cpp


@dataclass
class _Verified:
    """The last verified tree, until `commit`."""

    slot: int
    start: int  # the root's position
    seqs: list[int]  # sequence id per branch (the slot's own first)
    first_branch: list[int]  # node -> the first branch through it
    tokens: list[int]  # node -> token
    row: list[int]  # (root, nodes) -> its row after the root in the decode, i.e. its cell after the root's


class LlamaCppTarget(Target):
    def __init__(
        self, gguf: Path, max_context: int, num_slots: int, threads: int, tree_nodes: int = 0, exact: bool = False, repack: bool = True
    ) -> None:
        """`repack` False: weights in the file's layout whatever the probe would find (benchmarks
        measure the earlier exact mode that way)."""
        L = self._L = _llama_cpp()
        quiet_logs(L)
        self.gguf = Path(gguf)
        self.exact = exact
        self._native = native()
        self._native.set_batch_invariant(exact)  # fails here, not at the first decode, without the patch
        self.trees = tree_nodes > 0
        self._turn = compute_lock()
        self._load(max_context, num_slots, threads, tree_nodes, repacked=repack)
        if repack and exact and not self._probe_invariance():
            log.warning("%s: repacked weights reduce a row differently at some batch size on this machine; "
                        "exact mode keeps the file's layout (the patch's invariant kernels)", self.gguf.name)
            self._free()
            self._load(max_context, num_slots, threads, tree_nodes, repacked=False)

    def _load(self, max_context: int, num_slots: int, threads: int, tree_nodes: int, repacked: bool) -> None:
        L = self._L
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = repacked  # AMX / CPU-repack buffers where this machine has them
        self.repacked = repacked
        self._model = L.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.gguf}")
        # a tree of N nodes has at most N leaves, each its own sequence id beside the slots
        n_seq_max = num_slots + (tree_nodes if self.trees else 0)
        cells = max_context if self.trees else max_context * num_slots
        self._ctx = L.llama_init_from_model(self._model, self._context_params(cells, n_seq_max, threads))
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {cells} cells")
        self._pool = self._native.threadpool(threads, POLL)
        self._native.attach(self._ctx, self._pool)
        self._mem = L.llama_get_memory(self._ctx)
        self._embeddings_on = False
        vocab = L.llama_model_get_vocab(self._model)
        desc = ctypes.create_string_buffer(128)
        L.llama_model_desc(self._model, desc, len(desc))
        self.info = TargetInfo(
            backend="llamacpp",
            dtype=desc.value.decode().split()[-1],  # e.g. "llama 135M Q4_1" -> Q4_1
            threads=threads,
            vocab_size=L.llama_vocab_n_tokens(vocab),
            hidden_size=L.llama_model_n_embd(self._model),
            eos_token_id=L.llama_vocab_eos(vocab),
            max_context=max_context,
            num_slots=num_slots,
        )
        self._len: dict[int, int] = {}  # tokens in the cache, per slot
        self._redo: dict[int, list[int]] = {}  # exact mode: accepted tokens taken out of the cache, decoded next
        self._verified: _Verified | None = None
        self._n_seq_max = n_seq_max
        self._extra_seqs = list(range(num_slots, n_seq_max))
        self._batch = L.llama_batch_init(N_BATCH, 0, n_seq_max)
        b = self._batch  # numpy views of the batch's arrays, filled by _put
        self._tok = np.ctypeslib.as_array(b.token, shape=(N_BATCH,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(N_BATCH,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(N_BATCH,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(N_BATCH,))
        self._seq = [np.ctypeslib.as_array(b.seq_id[i], shape=(n_seq_max,)) for i in range(N_BATCH)]
        self._tables: tuple[Tensor, Tensor] | None = None

    def _context_params(self, cells: int, n_seq_max: int, threads: int):  # noqa: ANN202 (a llama_context_params)
        cp = self._L.llama_context_default_params()
        cp.n_seq_max = n_seq_max
        cp.kv_unified = self.trees
        cp.n_ctx = cells
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_threads = cp.n_threads_batch = threads
        cp.embeddings = False
        # Flash attention skips masked cells, so cells freed after the accepted depth of a verified
        # tree do not change later results; exact mode relies on its one-chunk path.
        cp.flash_attn_type = self._L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        return cp

    def _probe_invariance(self) -> bool:
        """Whether the last token of a decode of T tokens gets the logits it gets decoded alone, bit
        for bit, at every T of PROBE_SIZES (slot 0, left released)."""
        rng = random.Random(0)
        vocab = self.info.vocab_size
        prefix = [rng.randrange(vocab) for _ in range(8)]
        tokens = [rng.randrange(vocab) for _ in range(max(PROBE_SIZES))]
        if len(prefix) + len(tokens) >= self.info.max_context:
            return True  # too small a context to probe: nothing long enough to differ on
        try:
            self.prefill(0, prefix, features=False)
            alone = [self.forward([(0, [tok])])[0] for tok in tokens]
            for size in PROBE_SIZES:
                self.prefill(0, prefix, features=False)
                if not bool((self.forward([(0, tokens[:size])])[0] == alone[size - 1]).all()):
                    return False
            return True
        finally:
            self.release(0)

    def _free(self) -> None:
        L = self._L
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_pool", None):
            self._native.free_threadpool(self._pool)
            self._pool = None
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        if getattr(self, "_L", None) is not None:
            self._free()

    # -- one decode -------------------------------------------------------------------------------
    def _decode(self, n: int, outputs: int, features: bool) -> tuple[np.ndarray, Tensor | None]:
        """Decode the first `n` batch entries; (logits [outputs, V], a copy, hidden [outputs, D] or None)."""
        L = self._L
        if features != self._embeddings_on:
            L.llama_set_embeddings(self._ctx, features)
            self._embeddings_on = features
        self._batch.n_tokens = n
        self._native.set_batch_invariant(self.exact)
        with self._turn:
            start = time.perf_counter()
            rc = L.llama_decode(self._ctx, self._batch)
            end = time.perf_counter()
        self._decode_ms = 1000 * (end - start)
        if self.on_decode is not None:
            self.on_decode((n, outputs, features), start, end)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}" + (" (no room in the KV cache)" if rc == 1 else ""))
        # With embeddings on every token is an output; otherwise only the flagged ones, in batch order.
        rows = n if features else outputs
        logits = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(rows, self.info.vocab_size))[rows - outputs :].copy()
        if not features:
            return logits, None
        hidden = np.ctypeslib.as_array(L.llama_get_embeddings(self._ctx), shape=(rows, self.info.hidden_size))
        return logits, torch.from_numpy(hidden.copy())

    def _put(self, i: int, token: int, pos: int, seqs: Sequence[int], output: bool) -> None:
        self._tok[i], self._pos[i], self._out[i] = token, pos, output
        self._nseq[i] = len(seqs)
        self._seq[i][: len(seqs)] = seqs

    # -- Target -----------------------------------------------------------------------------------
    def forward(self, items: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
        total = sum(len(t) for _, t in items)
        if total > N_BATCH:
            raise ValueError(f"one step holds at most {N_BATCH} tokens, got {total}")
        # In slot order: with a KV stream per slot, llama.cpp puts into one ubatch only a run of
        # consecutive sequence ids (llama_batch_allocr::split_equal, sequential), and each ubatch
        # reads every weight again. Eight slots in the order they were admitted took up to 4 ubatches.
        order = sorted(range(len(items)), key=lambda k: items[k][0])
        i = 0
        for k in order:
            slot, tokens = items[k]
            if self._redo.get(slot):
                raise ValueError(f"slot {slot} has a verified tree to finish: forward() serves plain sequences")
            start = self._len.setdefault(slot, 0)
            for j, tok in enumerate(tokens):
                self._put(i, tok, start + j, (slot,), j == len(tokens) - 1)
                i += 1
            self._len[slot] = start + len(tokens)
        logits = self._decode(i, len(items), features=False)[0]
        if order == list(range(len(items))):
            return logits  # already the caller's order (one sequence, or a batch sent in slot order)
        out = np.empty_like(logits)
        out[order] = logits  # back to the caller's order
        return out

    def extend(self, slot: int, tokens: Sequence[int], features: bool) -> tuple[np.ndarray, Tensor | None]:
        redo = self._redo.pop(slot, [])
        tokens = [*redo, *tokens]  # tokens of the last tree that left the cache first, in order
        base = self._len.setdefault(slot, 0)
        hidden: list[Tensor] = []
        logits = np.empty(0, np.float32)
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start : start + N_BATCH]
            for j, tok in enumerate(chunk):
                self._put(j, tok, base + start + j, (slot,), j == len(chunk) - 1)
            out, h = self._decode(len(chunk), 1, features)
            logits = out[-1]
            if h is not None:
                hidden.append(h)
        self._len[slot] = base + len(tokens)
        return logits, torch.cat(hidden)[len(redo) :] if features else None

    def verify(self, slot: int, root: int, tree: DraftTree, features: bool) -> tuple[np.ndarray, Tensor | None]:
        # Accepted tokens of the last tree that left the cache (exact mode) go first, in every
        # branch's sequence: they are the prefix of the root.
        redo = self._redo.pop(slot, [])
        base = self._len[slot]
        start = base + len(redo)  # the root's position
        self._len[slot] = start
        if not len(tree):  # a plain step (budget 0): the root alone, on the slot's own sequence
            for j, tok in enumerate(redo):
                self._put(j, tok, base + j, (slot,), False)
            self._put(len(redo), root, start, (slot,), True)
            self._verified = _Verified(slot, start, [slot], [], [], [0])
            logits, hidden = self._decode(len(redo) + 1, 1, features)
            self.last_verify_ms = self._decode_ms
            return logits, None if hidden is None else hidden[len(redo) :]
        branches = tree.branches()  # one per leaf: the node ids from the root's child to the leaf
        seqs = [slot] + self._extra_seqs[: max(0, len(branches) - 1)]
        if len(seqs) < len(branches):
            raise ValueError(f"a tree with {len(branches)} leaves needs more sequence ids than this target has (tree_nodes)")
        for s in seqs[1:]:  # every branch sees the whole prefix (and nothing left from an earlier tree)
            self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
            self._L.llama_memory_seq_cp(self._mem, slot, s, -1, -1)
        member: list[list[int]] = [[] for _ in range(len(tree))]
        for b, nodes in enumerate(branches):
            for node in nodes:
                member[node].append(seqs[b])
        for j, tok in enumerate(redo):
            self._put(j, tok, base + j, seqs, False)
        self._put(len(redo), root, start, seqs, True)
        # Depth-first, first child first: cells are taken in batch order, so a path of first children
        # (each node's most likely candidate) gets consecutive cells and the cache after `commit` is
        # laid out exactly as after decoding that path as a chain (a hole between cells changes the
        # attention's rounding).
        order = tree.depth_first()
        depth, tokens = tree.depth.tolist(), tree.tokens.tolist()
        for row, i in enumerate(order, start=1):
            self._put(len(redo) + row, tokens[i], start + depth[i], member[i], True)
        back = [0] * (1 + len(tree))  # (root, nodes) -> row after the root
        for row, i in enumerate(order, start=1):
            back[1 + i] = row
        self._verified = _Verified(slot, start, seqs, [m[0] for m in member], tokens, back)
        logits, hidden = self._decode(len(redo) + 1 + len(tree), 1 + len(tree), features)
        self.last_verify_ms = self._decode_ms
        if hidden is not None:
            hidden = hidden[len(redo) :]
        return logits[back], None if hidden is None else hidden[back]

    def commit(self, slot: int, keep: Sequence[int]) -> None:
        v = self._verified
        if v is None or v.slot != slot or not keep or keep[0] != 0:
            raise ValueError("commit must follow verify on the same slot and keep the root first")
        self._verified = None
        if not v.tokens:  # a plain step: the root alone on the slot's own sequence, nothing to cut
            self._len[slot] = v.start + 1
            return
        L, mem = self._L, self._mem
        # the accepted path lies on the branch that the deepest accepted node names first
        best = v.first_branch[keep[-1] - 1] if len(keep) > 1 else slot
        for s in v.seqs:
            if s != best:
                L.llama_memory_seq_rm(mem, s, -1, -1)
        in_place = len(keep)
        if self.exact:  # the kept cells are in position order up to the first node whose row is not its depth
            in_place = next((d for d, node in enumerate(keep) if v.row[node] != d), len(keep))
            if in_place < len(keep):
                self._redo[slot] = [v.tokens[node - 1] for node in keep[in_place:]]
        L.llama_memory_seq_rm(mem, best, v.start + in_place, -1)  # the branch below what stays in the cache
        if best != slot:
            L.llama_memory_seq_cp(mem, best, slot, -1, -1)
            L.llama_memory_seq_rm(mem, best, -1, -1)
        self._len[slot] = v.start + in_place

    def truncate(self, slot: int, length: int) -> None:
        cached = self._len.get(slot, 0)
        if length >= cached:  # only tokens waiting to be decoded again go
            if slot in self._redo:
                self._redo[slot] = self._redo[slot][: length - cached]
            return
        self._redo.pop(slot, None)
        self._L.llama_memory_seq_rm(self._mem, slot, length, -1)
        self._len[slot] = length

    def release(self, slot: int) -> None:
        self._L.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._len.pop(slot, None)
        self._redo.pop(slot, None)
        if self._verified is not None and self._verified.slot == slot:  # a tree verified but never committed
            for s in self._verified.seqs[1:]:
                self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
            self._verified = None

    def length(self, slot: int) -> int:
        return self._len.get(slot, 0) + len(self._redo.get(slot, ()))

    def cached_tokens(self) -> int:
        """What llama.cpp itself holds, over every sequence id (tree branches included), not our
        bookkeeping: a leak here is a leak of cache cells. Positions of a sequence start at 0."""
        return sum(self._L.llama_memory_seq_pos_max(self._mem, s) + 1 for s in range(self._n_seq_max))

    def embeddings(self) -> tuple[Tensor, Tensor]:
        """The GGUF's token embedding and output tables, dequantized (the output is the embedding when tied)."""
        if self._tables is None:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            tensors = native().gguf_tensors(self.gguf, ["token_embd.weight", "output.weight"])

            def table(name: str) -> Tensor:
                t = tensors[name]
                rows = np.memmap(self.gguf, np.uint8, "r", offset=t.offset, shape=(t.nbytes,)).reshape(self.info.vocab_size, -1)
                return torch.from_numpy(np.ascontiguousarray(dequantize(rows, GGMLQuantizationType(t.ggml_type)), dtype=np.float32))

            embed = table("token_embd.weight")
            self._tables = (embed, table("output.weight") if "output.weight" in tensors else embed)
        return self._tables
