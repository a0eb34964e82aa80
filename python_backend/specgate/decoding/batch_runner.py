"""The baseline engine's scheduler: iteration-level (in-flight) batching over KV-cache slots.

One worker thread owns the target. Each iteration it
1. admits waiting requests into free slots (FIFO, so waiting is fair), then
2. runs ONE forward holding every running sequence's last token and the next prompt chunk of the
   sequences still reading their prompt (at most `PREFILL_CHUNK` prompt tokens per step, so a long
   prompt delays the others by a bounded amount), samples each sequence that has a new token with
   its own RNG, and emits it.
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

import numpy as np
import torch

from specgate.decoding.config import EngineConfig
from specgate.decoding.request import Event, GenerationRequest, check_prompt, hits_stop
from specgate.decoding.sampling import sample_token
from specgate.decoding.target import Target

log = logging.getLogger(__name__)

Emit = Callable[[Event], None]

PREFILL_CHUNK = 256  # prompt tokens per step, over all joining sequences


class QueueFull(RuntimeError):
    pass


@dataclass
class _Seq:
    req: GenerationRequest
    emit: Emit
    is_cancelled: Callable[[], bool]
    enqueued: float
    slot: int = -1
    read: int = 0  # prompt tokens already in the cache
    generated: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    done: bool = False  # its final event went out

    def __post_init__(self) -> None:
        self.stop_tail = self.req.stop_tail()  # computed once, checked at every token


class BatchRunner:
    def __init__(self, target: Target, cfg: EngineConfig) -> None:
        if target.info.num_slots < cfg.max_batch_size:
            raise ValueError(f"target has {target.info.num_slots} slots, max_batch_size is {cfg.max_batch_size}")
        self.target, self.cfg = target, cfg
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
        check_prompt(req, self.cfg.max_context, self.target.info.vocab_size)
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
                seq.gen = seq.req.sampling.generator()
            if self._active:
                try:
                    self._step()
                except Exception as exc:  # a bug here must not hang every client
                    log.exception("decode step failed")
                    for s in self._active:
                        self._finish(s, error=f"engine error: {exc}")
                self._active = [s for s in self._active if not s.done]

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

    def _step(self) -> None:
        """One forward: every running sequence's last token plus prompt chunks, then sample."""
        items: list[tuple[_Seq, list[int]]] = []
        budget = PREFILL_CHUNK
        for s in self._active:
            if s.is_cancelled():
                self._finish(s)
            elif s.read < len(s.req.input_ids):
                if budget > 0:
                    chunk = s.req.input_ids[s.read : s.read + budget]
                    budget -= len(chunk)
                    items.append((s, chunk))
            else:
                items.append((s, [s.generated[-1]]))
        if not items:
            return
        logits = self.target.forward([(s.slot, tokens) for s, tokens in items])
        for i, (s, tokens) in enumerate(items):
            s.read = min(s.read + len(tokens), len(s.req.input_ids))
            if s.generated or s.read == len(s.req.input_ids):  # mid-prompt chunks yield no token
                self._guard(s, lambda seq, row=logits[i]: self._accept(seq, row))

    def _accept(self, seq: _Seq, logits: np.ndarray) -> None:
        """Sample the next token, emit it, and finish the sequence if a stop condition holds."""
        assert seq.gen is not None
        tok = sample_token(logits, seq.req.sampling, seq.gen)
        if tok == seq.req.end_id:
            self._finish(seq)
            return
        seq.generated.append(tok)
        done = (
            len(seq.generated) >= seq.req.max_new_tokens
            or len(seq.req.input_ids) + len(seq.generated) >= self.cfg.max_context
            or hits_stop(seq.generated, seq.req.stop_words, seq.stop_tail)
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
            self.target.release(seq.slot)
            self._free.append(seq.slot)
            seq.slot = -1
        self._safe_emit(seq, Event(tokens or [], finished=True, error=error, cached_tokens=self.target.cached_tokens()))

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
