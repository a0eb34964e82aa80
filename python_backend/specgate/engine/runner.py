"""The baseline engine's scheduler: iteration-level (in-flight) batching over KV-cache slots.

One worker thread owns the model. Each iteration it
1. admits waiting requests into free slots (FIFO, so waiting is fair) and prefills them, then
2. runs ONE forward over every active sequence's last token (per-sequence positions), samples each
   with its own RNG, and emits each request's new token.
Finished or cancelled sequences free their slot at once; a request cancelled while it waits ends
at the next iteration; a request that waits past `queue_timeout_s` gets an error event, and one
that finds the queue full is refused (`QueueFull`). Every accepted request gets exactly one final
event, also when the engine shuts down. With `max_batch_size=1` it is a plain FIFO engine.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specgate.engine.config import EngineConfig
from specgate.engine.model import KVCache, Llama
from specgate.engine.request import Event, GenerationRequest, check_prompt, hits_stop
from specgate.engine.sampling import sample_token

log = logging.getLogger(__name__)

Emit = Callable[[Event], None]


class QueueFull(RuntimeError):
    pass


@dataclass
class _Seq:
    req: GenerationRequest
    emit: Emit
    is_cancelled: Callable[[], bool]
    enqueued: float
    slot: int = -1
    length: int = 0  # tokens in this slot's cache
    generated: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    done: bool = False  # its final event went out


class BatchRunner:
    def __init__(self, model: Llama, cfg: EngineConfig) -> None:
        self.model, self.cfg = model, cfg
        self.cache = KVCache(model.cfg, cfg.max_batch_size, cfg.max_context, cfg.torch_dtype)
        self._free = list(range(cfg.max_batch_size))
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="batch-runner", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, emit: Emit, is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Queue a request. Events arrive on `emit` from the worker thread; the last has finished=True."""
        check_prompt(req, self.cfg.max_context, self.model.cfg.vocab_size)
        with self._cv:
            if self._stop:
                raise RuntimeError("engine is shutting down")
            if len(self._waiting) >= self.cfg.max_queue_size:
                raise QueueFull(f"queue full ({self.cfg.max_queue_size} waiting); retry later")
            self._waiting.append(_Seq(req, emit, is_cancelled, time.monotonic()))
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + sum(not s.done for s in self._active)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # -- worker -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                stopping = self._stop
                if stopping:
                    admitted, dropped = [], [(s, "engine shut down") for s in [*self._waiting, *self._active]]
                    self._waiting.clear()
                else:
                    admitted, dropped = self._admit_locked()
            # Emit outside the lock: a slow response stream must not block submit().
            for seq, error in dropped:
                self._finish(seq, error=error)
            if stopping:
                return
            for seq in admitted:
                self._guard(seq, self._prefill)
            self._prune()
            if self._active:
                try:
                    self._decode_step()
                except Exception as exc:  # a bug here must not hang every client
                    log.exception("decode step failed")
                    for s in self._active:
                        self._finish(s, error=f"engine error: {exc}")
                self._prune()

    def _admit_locked(self) -> tuple[list[_Seq], list[tuple[_Seq, str | None]]]:
        """Move waiting requests into free slots, FIFO. Returns (admitted, dropped with their error).

        Every waiting request is checked each iteration, so a cancelled or timed-out one behind a
        full batch ends now rather than when it reaches a slot.
        """
        now, admitted, dropped, kept = time.monotonic(), [], [], collections.deque()
        for seq in self._waiting:
            if seq.is_cancelled():
                dropped.append((seq, None))
            elif now - seq.enqueued > self.cfg.queue_timeout_s:
                dropped.append((seq, f"timed out after {self.cfg.queue_timeout_s:g}s in queue"))
            elif self._free:
                seq.slot = min(self._free)
                self._free.remove(seq.slot)
                self._active.append(seq)
                admitted.append(seq)
            else:
                kept.append(seq)
        self._waiting = kept
        return admitted, dropped

    def _prune(self) -> None:
        """Drop finished sequences and pack the rest into slots 0..n-1, so that a decode step reads
        the cache through a view instead of gathering it (a copy per layer per step)."""
        self._active = [s for s in self._active if not s.done]
        for seq in sorted(self._active, key=lambda s: -s.slot):
            hole = min(self._free, default=self.cfg.max_batch_size)
            if hole > seq.slot:
                break
            self.cache.move(seq.slot, hole, seq.length)
            self._free.remove(hole)
            self._free.append(seq.slot)
            seq.slot = hole

    def _prefill(self, seq: _Seq) -> None:
        seq.gen = seq.req.sampling.generator()
        ids = torch.tensor([seq.req.input_ids])
        h = self.model(ids, self.cache, torch.tensor([seq.slot]), torch.tensor([0]))
        seq.length = ids.shape[1]
        self._accept(seq, self.model.logits(h[:, -1])[0])

    def _decode_step(self) -> None:
        live = []
        for s in sorted(self._active, key=lambda s: s.slot):
            if s.is_cancelled():
                self._finish(s)
            else:
                live.append(s)
        if not live:
            return
        ids = torch.tensor([[s.generated[-1]] for s in live])
        slots = torch.tensor([s.slot for s in live])
        lens = torch.tensor([s.length for s in live])
        logits = self.model.logits(self.model(ids, self.cache, slots, lens))[:, -1]
        for i, s in enumerate(live):
            s.length += 1
            self._guard(s, lambda seq, row=logits[i]: self._accept(seq, row))

    def _accept(self, seq: _Seq, logits: torch.Tensor) -> None:
        """Sample the next token, emit it, and finish the sequence if a stop condition holds."""
        assert seq.gen is not None
        tok = sample_token(logits, seq.req.sampling, seq.gen)
        if tok == seq.req.end_id:
            self._finish(seq)
            return
        seq.generated.append(tok)
        done = (
            len(seq.generated) >= seq.req.max_new_tokens
            or seq.length + 1 >= self.cfg.max_context
            or hits_stop(seq.generated, seq.req.stop_words)
        )
        if done:
            self._finish(seq, tokens=[tok])
        elif not self._safe_emit(seq, Event([tok])):
            self._finish(seq, error="response stream failed")

    def _finish(self, seq: _Seq, tokens: list[int] | None = None, error: str | None = None) -> None:
        """Free the slot and send the final event, once: later calls (e.g. a failed step after a
        cancellation in the same iteration) do nothing."""
        if seq.done:
            return
        seq.done = True
        if seq.slot >= 0:
            self._free.append(seq.slot)
            seq.slot = -1
        self._safe_emit(seq, Event(tokens or [], finished=True, error=error))

    def _guard(self, seq: _Seq, fn: Callable[[_Seq], None]) -> None:
        """Run one request's step; its failure ends that request only."""
        try:
            fn(seq)
        except Exception as exc:
            log.exception("request failed")
            self._finish(seq, error=f"engine error: {exc}")

    @staticmethod
    def _safe_emit(seq: _Seq, ev: Event) -> bool:
        try:
            seq.emit(ev)
            return True
        except Exception:  # the client went away: the caller frees the slot
            log.warning("dropping a request whose response stream failed", exc_info=True)
            return False
