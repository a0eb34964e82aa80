"""The speculative engine's scheduler: one sequence at a time, FIFO, on one worker thread.

Speculation already spends the spare compute of a step on draft tokens, so like TensorRT-LLM's
draft-target BLS flow this engine does not batch; `queue_depth` lets the gate's load rule send
overflow to the batched baseline instead.

The worker also owns calibration (cost_model/measure.py): at start, and again whenever
`recalibrate` is called, it measures the machine between requests and publishes the result: at
start, the median over this start's measurement and the last few starts' of the same engine
(cost_model/calibration_history.py); when asked, the new measurement alone.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specgate.cost_model.calibration import Calibration
from specgate.cost_model.calibration_history import CalibrationHistory, history_key
from specgate.cost_model.measure import calibrate
from specgate.decoding.batch_runner import QueueFull
from specgate.decoding.config import CalibrationOverride, EngineConfig
from specgate.decoding.request import Event, GenerationRequest, check_prompt
from specgate.decoding.target import Target
from specgate.speculative.drafter import Drafter
from specgate.speculative.generator import SpecStream, SpeculativeGenerator

log = logging.getLogger(__name__)

REPUBLISH_DRIFT = 1.1  # republish the calibration once the served one-token time moved this factor from it
# ... but a refined one at most this often. Why: on a noisy machine the live medians themselves
# move by more than REPUBLISH_DRIFT from request to request; on a 2-core EPYC under c=8 load the
# calibration was republished after nearly every request, about once a second, and the gauge and
# the gate's routing flapped with it. The first refinement after a calibration goes out at once.
REPUBLISH_MIN_INTERVAL_S = 30.0
# Calibration waits (at most this long) for the machine to go idle: at load the server's other
# models are still starting on the same cores.
IDLE_WAIT_AT_LOAD_S = 30.0
IDLE_WAIT_S = 5.0

Emit = Callable[[Event], None]


@dataclass
class _Job:
    req: GenerationRequest
    emit: Emit
    is_cancelled: Callable[[], bool]
    algorithm: str
    k: int  # the budget cap, resolved at submit
    enqueued: float


@dataclass
class _Calibrate:
    override: CalibrationOverride | None  # pinned measurements, or None to measure everything
    done: Callable[[Calibration | Exception], None]
    idle_wait_s: float = IDLE_WAIT_S
    at_load: bool = False  # the start's own calibration: pooled with earlier starts' (else asked for: taken alone)


class SpeculativeRunner:
    def __init__(
        self,
        target: Target,
        drafters: dict[str, Drafter],
        cfg: EngineConfig,
        on_calibration: Callable[[Calibration], None] = lambda _: None,
        calibrated: bool = True,
    ) -> None:
        """`calibrated` False: no cost curve, every step drafts k (exactness tests); else the worker
        calibrates first (cfg.calibration_override pins what it should not measure) and drafts only
        what pays."""
        self.cfg = cfg
        self.generator = SpeculativeGenerator(target, drafters)
        self.calibration: Calibration | None = None
        self._refined_at: float | None = None  # monotonic time of the last refinement since a calibration
        self._on_calibration = on_calibration
        log.info("speculative engine drafters: %s", sorted(drafters))
        self._q: queue.Queue[_Job | _Calibrate | None] = queue.Queue()
        self._hand_over_before = float("-inf")  # jobs enqueued at or before this stop at their next step
        if calibrated:
            self._q.put(_Calibrate(cfg.calibration_override, lambda _: None, IDLE_WAIT_AT_LOAD_S, at_load=True))
        self._thread = threading.Thread(target=self._loop, name="spec-runner", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._q.qsize()

    def submit(
        self,
        req: GenerationRequest,
        emit: Emit,
        is_cancelled: Callable[[], bool] = lambda: False,
        algorithm: str | None = None,
        k: int | None = None,
    ) -> None:
        """Validate now (ValueError: no, unknown or unloaded algorithm, k out of range, prompt too long
        or not token ids of the model), run later."""
        if not algorithm:
            raise ValueError("spec_engine needs the speculative_algorithm parameter (the gate's policy holds the default)")
        k = self.generator.check(algorithm, k)  # resolved here, once: the job carries the budget cap
        check_prompt(req, self.cfg.max_context, self.generator.target.info.vocab_size)
        if self._q.qsize() >= self.cfg.max_queue_size:
            raise QueueFull(f"queue full ({self.cfg.max_queue_size} waiting); retry later")
        self._q.put(_Job(req, emit, is_cancelled, algorithm, k, time.monotonic()))

    def recalibrate(self, done: Callable[[Calibration | Exception], None], override: CalibrationOverride | None = None) -> None:
        """Measure again (except what `override` pins) after the requests already queued; `done` gets the result.
        QueueFull like `submit`: a flood of them must not queue ahead of every request."""
        if self._q.qsize() >= self.cfg.max_queue_size:
            raise QueueFull(f"queue full ({self.cfg.max_queue_size} waiting); retry the calibration later")
        self._q.put(_Calibrate(override, done))

    def hand_over_all(self) -> None:
        """Stop every request submitted so far at its next step (or before it starts), with a final
        `handed_over` event: the gate continues it on the batched baseline. Later requests run."""
        self._hand_over_before = time.monotonic()

    def shutdown(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            if isinstance(item, _Calibrate):
                self._calibrate(item)
                continue
            try:
                self._run(item)
            except Exception as exc:
                log.exception("speculative request failed")
                _safe_emit(item, Event([], finished=True, error=f"engine error: {exc}"))

    def _calibrate(self, item: _Calibrate) -> None:
        try:
            cal = calibrate(self.generator.target, self.generator.drafters, item.override, idle_timeout_s=item.idle_wait_s)
            if self.cfg.calibration_path is not None and item.override is None:  # measured, nothing pinned
                history = CalibrationHistory(self.cfg.calibration_path, history_key(self.cfg, cal))
                cal = history.add(cal) if item.at_load else history.restart(cal)
            self.generator.set_curve(cal.curve)
            for name in cal.algorithms:
                self.generator.draft_cost[name] = cal.draft_cost(name)
            self.calibration, self._refined_at = cal, None
            self._on_calibration(cal)
            item.done(cal)
        except Exception as exc:  # keep serving: without a curve every step drafts k
            log.exception("calibration failed")
            item.done(exc)

    def _run(self, job: _Job) -> None:
        if time.monotonic() - job.enqueued > self.cfg.queue_timeout_s:
            self._end(job, Event([], finished=True, error=f"timed out after {self.cfg.queue_timeout_s:.0f}s in queue"))
            return
        if job.enqueued <= self._hand_over_before:  # asked to hand over while it waited
            self._end(job, Event([], finished=True, handed_over=True))
            return
        if job.is_cancelled():  # while it waited: not even a prefill
            self._end(job, Event([], finished=True))
            return
        r = job.req
        stream = self.generator.start(r.input_ids, r.max_new_tokens, r.sampling, job.algorithm, job.k, r.end_id, r.stop_words,
                                      r.stop_tail())
        try:
            final = self._stream(job, stream)
        finally:
            stream.close()  # frees the slot, before the final event reports the cache
        self._end(job, final)
        try:  # the request has had its final event: a failure here must not send it another
            self._republish()
        except Exception:
            log.exception("could not republish the calibration")

    def _republish(self) -> None:
        """Publish what serving taught once it moved enough: the one-token time (the measured curve
        rescaled to it) and the drafting times. The gauge and the gate then read the machine's speed
        now, on the curve's quiet shape (Calibration.refined)."""
        cal, curve = self.calibration, self.generator.curve
        if cal is None or curve is None or curve.pinned:
            return
        if math.exp(abs(math.log(curve.cost(1) / cal.curve.ms[0]))) < REPUBLISH_DRIFT:
            return
        if self._refined_at is not None and time.monotonic() - self._refined_at < REPUBLISH_MIN_INTERVAL_S:
            return
        self._refined_at = time.monotonic()
        draft_ms = {name: cost.ms for name, cost in self.generator.draft_cost.items() if cost.ms > 0}
        at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        self.calibration = cal.refined(curve.cost(1), draft_ms, at)
        log.info("calibration rescaled to served decodes: %s", self.calibration.curve.table())
        self._on_calibration(self.calibration)

    def _stream(self, job: _Job, stream: SpecStream) -> Event:
        """Emit the request's tokens as they come; returns its final event."""
        r = job.req
        emitted = 0
        for tokens in stream:
            if job.is_cancelled():
                break
            if not _safe_emit(job, Event(tokens, stats=stream.stats)):  # the client went away: stop
                return Event([], finished=True, stats=stream.stats, error="response stream failed")
            emitted += len(tokens)
            # Hand over only a request that still has work and room: the baseline continues from
            # prompt + emitted tokens (a finished one would run past its stop sequence).
            if (
                job.enqueued <= self._hand_over_before
                and stream.finish_reason is None
                and len(r.input_ids) + emitted + 1 < self.cfg.max_context
            ):
                return Event([], finished=True, stats=stream.stats, handed_over=True)
        return Event([], finished=True, stats=stream.stats)

    def _end(self, job: _Job, final: Event) -> None:
        final.cached_tokens = self.generator.target.cached_tokens()
        _safe_emit(job, final)


def _safe_emit(job: _Job, ev: Event) -> bool:
    """Send one event; a failing response stream ends that request only, never the worker thread."""
    try:
        job.emit(ev)
        return True
    except Exception:
        log.warning("dropping a speculative request whose response stream failed", exc_info=True)
        return False
