"""Triton adapter for the CPU engines: engine-contract tensors in, decoupled responses out.

Like the tensorrtllm backend: with `streaming` true each step's new tokens go out as they are made;
otherwise exactly one response holds the whole output (HTTP `generate` needs exactly one).

Every request, a generation or a control message, must carry the engine key (serving/engine_key.py):
the engines serve spec_gate, not the network.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import astuple
from typing import Any, Callable

import numpy as np
import triton_python_backend_utils as pb_utils
from pydantic import BaseModel

from specgate.algorithms import MAX_TREE_NODES
from specgate.contract import (
    PARAM_ALGORITHM,
    PARAM_CALIBRATE,
    PARAM_CANCEL,
    PARAM_CONTINUED,
    PARAM_HAND_OVER,
    PARAM_NUM_SPEC_TOKENS,
    PARAM_PING,
    PARAM_REQUEST_KEY,
    VERIFY_COST_METRIC,
)
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.stream_pacer import StreamPacer
from specgate.decoding.config import CalibrationOverride, EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.request import Event, GenerationRequest
from specgate.decoding.sampling import SamplingParams
from specgate.decoding.target import Target
from specgate.errors import InvalidInput
from specgate.machine import machine
from specgate.serving.engine_key import EngineKey
from specgate.serving.engine_metrics import EngineMetrics
from specgate.serving.live_requests import LiveRequests
from specgate.serving.outbox import Outbox
from specgate.serving.parent_watch import watch_parent
from specgate.serving.triton_io import (
    FINAL,
    RequestedOutputsSender,
    error_response,
    model_parameters,
    optional_array,
    optional_scalar,
    request_parameters,
    tensor,
)
from specgate.stats import SpecStats
from specgate.text.stop_words import parse_stop_words_list

log = logging.getLogger(__name__)

# Triton's cancellation flag is an IPC round trip to the server (about 0.1 ms, and it wakes a server
# thread on the cores the engine decodes on): asked at most this often, not at every decode step.
CANCEL_POLL_S = 0.02


def parse_engine_request(request: Any, cfg: EngineConfig, params: dict[str, Any] | None = None) -> tuple[GenerationRequest, bool]:
    """Contract tensors and request parameters -> GenerationRequest (+ streaming flag). Raises InvalidInput."""
    ids = optional_array(request, "input_ids")
    if ids is None or ids.size == 0:
        raise InvalidInput("input_ids is empty")
    out_len = optional_scalar(request, "request_output_len")
    if out_len is None or not 1 <= int(out_len) <= cfg.max_output_len:
        raise InvalidInput(f"request_output_len must be between 1 and {cfg.max_output_len}, got {out_len}")
    stops = optional_array(request, "stop_words_list")
    temperature = optional_scalar(request, "temperature")
    top_k = optional_scalar(request, "runtime_top_k")
    top_p = optional_scalar(request, "runtime_top_p")
    seed = optional_scalar(request, "seed")
    try:
        sampling = SamplingParams(
            temperature=0.0 if temperature is None else float(temperature),
            top_k=0 if top_k is None else int(top_k),
            top_p=1.0 if top_p is None else float(top_p),
            seed=None if seed is None else int(seed),
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    end_id = optional_scalar(request, "end_id")
    continued = (params or {}).get(PARAM_CONTINUED, 0)
    if not isinstance(continued, int) or isinstance(continued, bool) or continued < 0:
        raise InvalidInput(f"{PARAM_CONTINUED} must be a count of tokens (an integer >= 0), got {continued!r}")
    req = GenerationRequest(
        input_ids=[int(i) for i in ids.reshape(-1)],
        max_new_tokens=int(out_len),
        end_id=None if end_id is None else int(end_id),
        stop_words=[] if stops is None else parse_stop_words_list(stops),
        sampling=sampling,
        continued=continued,
    )
    return req, bool(optional_scalar(request, "streaming") or False)


class ResponseStream:
    """Turns one request's engine Events into Triton responses.

    The engine's decode loop only records events here; the engine's `Outbox` thread sends them, so a
    decode step never waits for the IPC of a send. A streamed response goes out when the engine's
    `pacer` says it is due (the first and the last at once); tokens made in between go out together.
    Each response costs CPU in three processes (this stub, Triton, the gate) on the
    cores the engine may decode on, and the pacer keeps that within a budget of the decode time
    (cost_model/stream_pacer.py). Without a pacer every event is due.
    `on_final` runs on the sender's thread after the last response.
    """

    def __init__(
        self,
        sender: Any,
        streaming: bool,
        outbox: Outbox,
        pacer: StreamPacer | None = None,
        on_final: Callable[["ResponseStream", Event], None] | None = None,
    ) -> None:
        self.sender, self.streaming, self.outbox, self.pacer = sender, streaming, outbox, pacer
        self.on_final = on_final
        self.last_flush = float("-inf")
        self.tokens: list[int] = []  # everything emitted so far
        self.sent = 0  # of which already in a response
        self.last: Event | None = None  # the newest event (stats, flags)
        self.failed = False  # a send raised: the client is gone
        self.cancelled = False  # the client cancelled (Triton's flag) or the gate asked (PARAM_CANCEL)
        self.polled = float("-inf")  # when Triton's flag was last asked
        # the draft statistics the gate holds: those of the last response that carried them, and
        # before any, the empty ones it starts from (engine_client.EngineClient.run)
        self.stats_sent = astuple(SpecStats())
        self.scheduled = False
        self.lock = threading.Lock()
        self.paced = False  # the pacer counts this stream as open: from its first event to its last

    def __call__(self, ev: Event) -> None:
        if self.streaming and self.pacer is not None and not self.paced:
            self.paced = True
            self.pacer.opened()
        with self.lock:
            self.tokens += ev.tokens
            self.last = ev
            paced = self.pacer is None or self.pacer.due(self.last_flush, time.monotonic())
            due = ev.finished or (self.streaming and ev.tokens and paced)
            if self.scheduled or not due:
                return
            self.scheduled = True
        self.outbox.schedule(self)

    def cancel(self) -> None:
        self.cancelled = True

    def is_cancelled(self) -> bool:
        if not (self.failed or self.cancelled) and time.monotonic() - self.polled >= CANCEL_POLL_S:
            self.polled = time.monotonic()
            # The IPC: asked last, and not too often. Only ever sets the flag: the gate's cancel()
            # can land on the execute thread while this asks (the gate's BLS request itself is never
            # flagged), and assigning the answer overwrote it: the engine ran to max_tokens.
            if self.sender.is_cancelled():
                self.cancelled = True
        return self.failed or self.cancelled

    def flush(self) -> None:
        """Send what is pending (on the sender thread)."""
        with self.lock:
            self.scheduled = False
            self.last_flush = time.monotonic()
            ev, tokens, final = self.last, self.tokens[self.sent :], bool(self.last and self.last.finished)
            self.sent = len(self.tokens)
        if ev is None:
            return
        if not self.failed:
            try:
                if ev.error is not None:
                    self.sender.send(error_response(ev.error, invalid_arg=False), flags=FINAL)
                elif self.streaming:
                    self.sender.send(self._response(tokens, ev, final), flags=FINAL if final else 0)
                elif final:
                    self.sender.send(self._response(self.tokens, ev, final), flags=FINAL)
                if self.pacer is not None:
                    self.pacer.sent()
            except Exception:  # the client went away: the engine stops this request at its next step
                log.warning("response stream failed", exc_info=True)
                self.failed = True
        if final and self.paced and self.pacer is not None:
            self.pacer.closed()
        if final and self.on_final is not None:
            self.on_final(self, ev)

    def _response(self, tokens: list[int], ev: Event, final: bool) -> Any:
        """The tokens, and the draft statistics where they changed since the last response that
        carried them, and always on the final one (the only event that sets `handed_over`). Why:
        every tensor of a response is copied through shared memory by this stub, Triton and the
        gate, on the cores the engine decodes on, and the baseline's statistics never change. The
        gate keeps the last statistics it read (engine_client._stats)."""
        s = ev.stats or SpecStats()
        ids = [tensor("output_ids", [[tokens]], np.int32), tensor("sequence_length", [[len(self.tokens)]], np.int32)]
        snapshot = astuple(s)
        if not final and snapshot == self.stats_sent:
            return pb_utils.InferenceResponse(output_tensors=ids)
        self.stats_sent = snapshot
        return pb_utils.InferenceResponse(
            output_tensors=[
                *ids,
                *(pb_utils.Tensor(name, value) for name, value in s.to_tensors().items()),
                tensor("handed_over", [[ev.handed_over]], np.bool_),
            ]
        )


class EngineParameters(BaseModel):
    """An engine's config.pbtxt parameters."""

    engine_config: str  # the EngineConfig JSON build_engines wrote


class EngineModel:
    """Base adapter; subclasses choose the runner that owns the target."""

    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        watch_parent()
        self.cfg = EngineConfig.load(model_parameters(args, EngineParameters).engine_config)
        self.name = args["model_name"]
        self.key = EngineKey.from_env()
        self.outbox = Outbox("response-sender")
        self.live = LiveRequests()
        self.metrics = EngineMetrics(pb_utils, self.name)
        self.runner = self.make_runner(self.cfg)
        self.pacer = StreamPacer(self.cfg.stream_cost_budget, self.cfg.stream_interval_ms)
        self.runner_target().on_decode = self.pacer.decoded
        self.metrics.streaming(self.pacer.pace)
        info = self.runner_target().info
        log.info(
            "%s ready on %s: %s %s, %d threads, batch %d", self.name, machine().line(), info.backend, info.dtype, info.threads,
            self.cfg.max_batch_size,
        )

    def make_runner(self, cfg: EngineConfig) -> Any:
        raise NotImplementedError

    def runner_target(self) -> Target:
        raise NotImplementedError

    def submit(self, req: GenerationRequest, emit: Callable[[Event], None], is_cancelled: Callable[[], bool], params: dict) -> None:
        self.runner.submit(req, emit, is_cancelled)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = RequestedOutputsSender(request)
            try:
                params = request_parameters(request)
                self.key.check(params, self.name)  # InvalidInput for a caller that is not spec_gate
                if self.control(params, sender):
                    continue
                req, streaming = parse_engine_request(request, self.cfg, params)
                key = params.get(PARAM_REQUEST_KEY)
                key = None if key is None else str(key)
                stream = ResponseStream(sender, streaming, self.outbox, self.pacer, on_final=lambda s, ev, key=key: self._ended(s, ev, key))
                self._track(stream, key)
                try:
                    self.submit(req, stream, stream.is_cancelled, params)
                except Exception:
                    self._untrack(key)
                    raise
            except (InvalidInput, ValueError) as exc:
                sender.send(error_response(str(exc)), flags=FINAL)
            except Exception as exc:  # QueueFull and anything unexpected: answer, never drop
                log.exception("could not queue request")
                sender.send(error_response(str(exc), invalid_arg=False), flags=FINAL)
        return None

    def control(self, params: dict, sender: Any) -> bool:
        """Handle a control message (not a generation); True if `params` held one."""
        if PARAM_CANCEL in params:  # the gate: its client cancelled the request with this key
            self.live.cancel(str(params[PARAM_CANCEL]))
        elif not params.get(PARAM_PING):  # the gate: are you alive? (answering is the answer)
            return False
        self.reply(sender)
        return True

    def reply(self, sender: Any, error: str | None = None) -> None:
        """Answer a control message with one final response (an error if `error`)."""
        ResponseStream(sender, False, self.outbox)(Event([], finished=True, error=error))

    def _track(self, stream: ResponseStream, key: str | None) -> None:
        self.metrics.started()
        if key is not None:
            self.live.add(key, stream)

    def _untrack(self, key: str | None) -> None:
        """A request that was refused after `_track`."""
        if key is not None:
            self.live.discard(key)
        self.metrics.ended(0, None, False)

    def _ended(self, stream: ResponseStream, final: Event, key: str | None) -> None:
        if key is not None:
            self.live.discard(key)
        self.metrics.ended(len(stream.tokens), final.cached_tokens, stream.cancelled)
        self.metrics.streaming(self.pacer.pace)

    def finalize(self) -> None:
        self.runner.shutdown()
        self.outbox.shutdown()


class BaselineEngineModel(EngineModel):
    def make_runner(self, cfg: EngineConfig) -> Any:
        from specgate.decoding.batch_runner import BatchRunner

        return BatchRunner(load_target(cfg, cfg.model, num_slots=cfg.max_batch_size, exact=cfg.exact), cfg)

    def runner_target(self) -> Target:
        return self.runner.target


class SpeculativeEngineModel(EngineModel):
    def make_runner(self, cfg: EngineConfig) -> Any:
        from specgate.speculative.registry import build_drafters
        from specgate.speculative.spec_runner import SpeculativeRunner

        target = load_target(cfg, cfg.model, num_slots=1, tree_nodes=MAX_TREE_NODES, exact=cfg.exact)
        self.cost_gauge = pb_utils.MetricFamily(
            name=VERIFY_COST_METRIC, description="Measured time of one verification decode, by tokens verified",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        if cfg.calibration_path is not None:  # the last run's: this engine measures first, the gate meanwhile routes around it
            Calibration.withdraw(cfg.calibration_path)
        return SpeculativeRunner(target, build_drafters(target, cfg), cfg, on_calibration=self._publish)

    def runner_target(self) -> Target:
        return self.runner.generator.target

    def _publish(self, cal: Calibration) -> None:
        """Log the calibration, export the curve as a gauge and write it for the gate."""
        log.info("spec_engine %s", cal.summary())
        for tokens, ms in zip(cal.curve.tokens, cal.curve.ms):
            self.cost_gauge.Metric(labels={"tokens": str(tokens)}).set(ms / 1000)
        if self.cfg.calibration_path is not None:
            cal.save(self.cfg.calibration_path)

    def control(self, params: dict, sender: Any) -> bool:
        if super().control(params, sender):
            return True
        if params.get(PARAM_HAND_OVER):  # the gate asks: hand every running request over to the baseline
            self.runner.hand_over_all()
            self.reply(sender)
            return True
        if PARAM_CALIBRATE in params:  # an operator asks: measure again (pinning what the value says)
            value = params[PARAM_CALIBRATE]
            override = CalibrationOverride.model_validate_json(value) if value not in ("", True) else None

            def done(result: Any) -> None:
                self.reply(sender, f"calibration failed: {result}" if isinstance(result, Exception) else None)

            self.runner.recalibrate(done, override)
            return True
        return False

    def submit(self, req: GenerationRequest, emit: Callable[[Event], None], is_cancelled: Callable[[], bool], params: dict) -> None:
        k = params.get(PARAM_NUM_SPEC_TOKENS)
        self.runner.submit(req, emit, is_cancelled, params.get(PARAM_ALGORITHM), None if k is None else int(k))
