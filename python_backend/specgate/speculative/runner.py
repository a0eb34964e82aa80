"""The speculative engine's scheduler: one sequence at a time, FIFO.

Speculation already spends the spare compute of a step on draft tokens, so like TensorRT-LLM's
draft-target BLS flow this engine does not batch; `queue_depth` lets the gate's load rule send
overflow to the batched baseline instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specgate.engine.config import EngineConfig
from specgate.engine.model import Llama
from specgate.engine.request import Event, GenerationRequest, check_prompt
from specgate.engine.runner import QueueFull
from specgate.speculative.registry import build_drafters, check_request
from specgate.speculative.generator import SpeculativeGenerator

log = logging.getLogger(__name__)


@dataclass
class _Job:
    req: GenerationRequest
    emit: Callable[[Event], None]
    is_cancelled: Callable[[], bool]
    algorithm: str
    k: int | None
    enqueued: float


class SpeculativeRunner:
    def __init__(self, model: Llama, cfg: EngineConfig) -> None:
        self.cfg = cfg
        drafters = build_drafters(model, cfg.max_context, cfg.draft_model_dir, cfg.eagle_head_dir)
        self.generator = SpeculativeGenerator(model, drafters, cfg.max_context)
        log.info("speculative engine drafters: %s", sorted(drafters))
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._hand_over_before = float("-inf")  # jobs enqueued at or before this stop at their next step
        self._thread = threading.Thread(target=self._loop, name="spec-runner", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._q.qsize()

    def submit(
        self,
        req: GenerationRequest,
        emit: Callable[[Event], None],
        is_cancelled: Callable[[], bool] = lambda: False,
        algorithm: str | None = None,
        k: int | None = None,
    ) -> None:
        """Validate now (ValueError: unknown algorithm, k out of range, prompt too long or not token
        ids of the model), run later."""
        algorithm = algorithm or self.cfg.default_algorithm
        check_request(algorithm, k, self.generator.drafters)
        check_prompt(req, self.cfg.max_context, self.generator.target.cfg.vocab_size)
        if self._q.qsize() >= self.cfg.max_queue_size:
            raise QueueFull(f"queue full ({self.cfg.max_queue_size} waiting); retry later")
        self._q.put(_Job(req, emit, is_cancelled, algorithm, k, time.monotonic()))

    def hand_over_all(self) -> None:
        """Stop every request submitted so far at its next step (or before it starts), with a final
        `handed_over` event: the gate continues it on the batched baseline. Later requests run."""
        self._hand_over_before = time.monotonic()

    def shutdown(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                self._run(job)
            except Exception as exc:
                log.exception("speculative request failed")
                job.emit(Event([], finished=True, error=f"engine error: {exc}"))

    def _run(self, job: _Job) -> None:
        if time.monotonic() - job.enqueued > self.cfg.queue_timeout_s:
            job.emit(Event([], finished=True, error=f"timed out after {self.cfg.queue_timeout_s:.0f}s in queue"))
            return
        if job.enqueued <= self._hand_over_before:  # asked to hand over while it waited
            job.emit(Event([], finished=True, handed_over=True))
            return
        r = job.req
        stream = self.generator.generate(
            r.input_ids, r.max_new_tokens, r.sampling, job.algorithm, job.k, r.end_id, r.stop_words
        )
        emitted = 0
        for tokens in stream:
            if job.is_cancelled():
                break
            job.emit(Event(tokens, stats=stream.stats))
            emitted += len(tokens)
            # Hand over only a request that still has work and room: the baseline continues from
            # prompt + emitted tokens (a finished one would run past its stop sequence).
            if (
                job.enqueued <= self._hand_over_before
                and stream.finish_reason is None
                and len(r.input_ids) + emitted + 1 < self.cfg.max_context
            ):
                job.emit(Event([], finished=True, stats=stream.stats, handed_over=True))
                return
        job.emit(Event([], finished=True, stats=stream.stats))
