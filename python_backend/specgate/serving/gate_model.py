"""Triton adapter for `spec_gate`: decide the route, forward over BLS, stream back, record metrics.

Every request is served on a worker thread so the decoupled `execute` returns at once and many
requests stream concurrently, as many as the admission queue lets in (specgate.gate.admission;
past it: UNAVAILABLE "overloaded"). The policy itself lives in `specgate.gate` (tested without
Triton).

Failure handling: if `spec_engine` fails or is unavailable, the request continues on
`target_engine` from the tokens already streamed (prompt + emitted ids), so the client sees no
error, and the failure is counted (repeated failures open the tenant's circuit).

Hand-over under load: when the load rule sends a request to the baseline while speculative
requests are running, the gate asks spec_engine (CPU engines only) to hand them over; each then
continues on the batched baseline the same way, with reason `load`. Otherwise a speculative request
that started alone keeps the one-at-a-time engine busy beside the batch, and both slow down.

Cancellation and dead engines (CPU engines only; docs/robustness.md): each response carries the
request's key, which postprocessing sends back when the client has cancelled; the gate then stops
the request and tells its engines to stop it too. An engine request that stays silent is checked
with a ping, so a dead engine process fails the request instead of hanging it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from specgate.contract import (
    ENGINE_EXTENSIONS, ENGINE_OUTPUTS, HEADER_API_KEY, HEADER_SPEC_MODE, LLM_INPUTS, PARAM_ALGORITHM, PARAM_CANCEL, PARAM_HAND_OVER,
    PARAM_NUM_SPEC_TOKENS, PARAM_PING, PARAM_REQUEST_KEY, REQUEST_KEY_TENSOR, engine_inputs,
)
from specgate.gate import Decision, Gate, PolicyError
from specgate.gate.admission import Overloaded, Ticket
from specgate.gate.labels import label_secret_from_env
from specgate.gate.policy import MAX_CONCURRENT_CAP, MAX_QUEUED_CAP
from specgate.gate.router import LOAD  # also the reason of a speculative request handed over
from specgate.serving.bls import Cancelled, EngineFailure, responses
from specgate.serving.llm_request import LLMRequest, parse_llm_request
from specgate.serving.triton_io import (
    FINAL, cancelled_response, error_response, optional_array, optional_scalar, request_parameters, tensor, unavailable_response,
)
from specgate.stats import SpecStats
from specgate.errors import InvalidInput

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

ENGINE_OUTPUT_NAMES = [t.name for t in ENGINE_OUTPUTS]
EXTENSION_OUTPUT_NAMES = [t.name for t in ENGINE_EXTENSIONS]
GATE_KNOBS = tuple(t for t in LLM_INPUTS if t.step == "spec_gate")  # what spec_gate reads of a request
FALLBACK = "spec_engine_failure"  # gate_reason when a speculative request finished on baseline


CONTROL_TIMEOUT_S = 10.0  # an engine answers a control message at once; silence this long: it is gone


class HandedOver(Exception):
    """spec_engine stopped the request early, as the gate asked: continue it on the baseline."""


def _out(resp: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()


def _stop_words(arr: np.ndarray | None) -> np.ndarray | None:
    """preprocessing's [2, n] stop_words_list, or None when it holds no stop sequence."""
    if arr is None or arr.size < 2 or arr.size % 2:
        return None
    arr = arr.reshape(2, -1)
    return arr if (arr[1] >= 0).any() else None


def _bls_request(engine: str, arrays: dict[str, np.ndarray], outputs: list[str], params: dict[str, Any]) -> Any:
    """A BLS request to an engine model from `contract.engine_inputs` arrays."""
    inputs = [pb_utils.Tensor(name, arr) for name, arr in arrays.items()]
    return pb_utils.InferenceRequest(model_name=engine, inputs=inputs, requested_output_names=outputs, parameters=params)


def _stats(resp: Any, last: SpecStats) -> SpecStats:
    """Cumulative draft statistics from an engine response; engines may omit them on some responses."""
    drafted, accepted = _out(resp, "total_draft_tokens"), _out(resp, "total_accepted_draft_tokens")
    if drafted is None or accepted is None:
        return last
    drafts, per_pos, budget = _out(resp, "num_drafts"), _out(resp, "accepted_per_position"), _out(resp, "draft_budget")
    return SpecStats(
        num_drafts=0 if drafts is None else int(drafts.reshape(-1)[0]),
        draft_tokens=int(drafted.reshape(-1)[0]),
        accepted_tokens=int(accepted.reshape(-1)[0]),
        accepted_per_position=[] if per_pos is None else [int(x) for x in per_pos.reshape(-1) if x > 0],
        draft_budget=-1 if budget is None else int(budget.reshape(-1)[0]),
    )


class GateModel:
    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.max_output_len = int(p["max_output_len"])
        self.end_id = int(p["end_id"])
        self.extensions = p["engine_extensions"] == "true"
        self.outputs = ENGINE_OUTPUT_NAMES + (EXTENSION_OUTPUT_NAMES if self.extensions else [])
        self.gate = Gate(
            p["policy_path"], metric_factory=pb_utils, label_secret=label_secret_from_env(), calibration_path=p.get("calibration_path") or None
        )
        # One thread per admitted or queued request (the admission queue bounds them), plus the
        # hand-over message; threads start only as needed.
        self.pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CAP + MAX_QUEUED_CAP + 1, thread_name_prefix="gate")
        self.mirrors = ThreadPoolExecutor(max_workers=8, thread_name_prefix="shadow")
        self._speculating = 0  # speculative requests and mirrors now on spec_engine
        self._lock = threading.Lock()
        self._handing_over = threading.Lock()  # at most one hand-over message in flight
        self._live: dict[int, threading.Event] = {}  # request key -> set when its client cancelled

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            ticket = decision = None
            try:
                params = request_parameters(request)
                if PARAM_CANCEL in params:  # postprocessing: the client of this key cancelled
                    self._cancel(params[PARAM_CANCEL])
                    sender.send(flags=FINAL)
                    continue
                llm = self._parse(request, params)
                prompt = [int(t) for t in optional_array(request, "input_ids").reshape(-1)]
                stops = _stop_words(optional_array(request, "stop_words_list"))
                ticket = self.gate.admission.enter()
                decision = self.gate.decide(llm)
                self.pool.submit(self._serve, sender, llm, decision, prompt, stops, ticket)
                if decision.reason == LOAD and self.extensions and self._speculating:
                    self.pool.submit(self._hand_over)
            except Overloaded as exc:
                sender.send(unavailable_response(str(exc)), flags=FINAL)
            except (InvalidInput, PolicyError) as exc:
                if ticket is not None:
                    self.gate.admission.leave(ticket)
                sender.send(error_response(str(exc)), flags=FINAL)
            except Exception as exc:  # answer, and release what the request took
                log.exception("could not start request")
                if ticket is not None:
                    self.gate.admission.leave(ticket)
                if decision is not None:
                    self.gate.finish(decision)
                sender.send(error_response(f"gate error: {exc}", invalid_arg=False), flags=FINAL)
        return None

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.mirrors.shutdown(wait=False, cancel_futures=True)

    def _parse(self, request: Any, params: dict[str, Any]) -> LLMRequest:
        fields = {t.name: optional_scalar(request, t.name) for t in GATE_KNOBS}
        fields = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in fields.items()}
        fields["api_key"] = params.get(HEADER_API_KEY)
        header = params.get(HEADER_SPEC_MODE)
        fields["spec_header"] = None if header is None else str(header)
        fields["request_id"] = request.request_id() or ""
        return parse_llm_request(fields, self.max_output_len)

    # -- serving ---------------------------------------------------------------------------------
    def _serve(self, sender: Any, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None, ticket: Ticket) -> None:
        key = secrets.randbits(63)
        out = _Output(sender, llm.stream, d.route, d.reason, key)
        cancel = threading.Event()
        with self._lock:
            self._live[key] = cancel
        try:
            try:
                self.gate.admission.wait(ticket)
            except Overloaded:
                if d.shadow:
                    self.gate.end_shadow(d, None)  # its mirror never started
                raise
            if d.route == "speculative":
                self._serve_speculative(out, cancel, llm, d, prompt, stops)
            else:
                self._serve_baseline(out, cancel, llm, d, prompt, stops)
            out.finish()
        except Cancelled:  # no acceptance sample: a reply's first tokens are not a fair one
            self.gate.record_cancelled()
            out.fail(cancelled_response("cancelled by the client"))
        except Overloaded as exc:
            out.fail(unavailable_response(str(exc)))
        except (EngineFailure, InvalidInput) as exc:
            out.fail(error_response(str(exc), invalid_arg=isinstance(exc, InvalidInput)))
        except Exception as exc:  # never leave a client without a final response
            log.exception("gate failed")
            out.fail(error_response(f"gate error: {exc}", invalid_arg=False))
        finally:
            with self._lock:
                del self._live[key]
            self.gate.admission.leave(ticket)
            self.gate.finish(d)

    def _serve_speculative(
        self, out: _Output, cancel: threading.Event, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None
    ) -> None:
        try:
            stats = self._run("spec_engine", llm, d, prompt, stops, out.send, cancel)
            self.gate.record_speculative(d, stats)
        except HandedOver:
            self.gate.record_speculative(d, out.stats)
            # the response keeps reporting the drafts made before the hand-over
            self._continue_on_baseline(out, cancel, LOAD, out.stats, llm, d, prompt, stops)
        except EngineFailure as exc:
            log.warning("spec_engine failed, continuing on target_engine: %s", exc)
            self.gate.record_failure(d, "speculative")
            self._continue_on_baseline(out, cancel, FALLBACK, SpecStats(), llm, d, prompt, stops)

    def _serve_baseline(
        self, out: _Output, cancel: threading.Event, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None
    ) -> None:
        mirror = self._start_mirror(llm, d, prompt, stops, cancel) if d.shadow else None
        try:
            self._run("target_engine", llm, d, prompt, stops, out.send, cancel)
        except (EngineFailure, Cancelled) as exc:
            if isinstance(exc, EngineFailure):
                self.gate.record_failure(d, "baseline")
            if mirror is not None:
                self.mirrors.submit(self._end_mirror, d, mirror, None)
            raise
        if mirror is not None:
            self.mirrors.submit(self._end_mirror, d, mirror, out.ids if llm.temperature == 0 else None)

    def _continue_on_baseline(
        self, out: _Output, cancel: threading.Event, reason: str, stats: SpecStats, llm: LLMRequest, d: Decision, prompt: list[int],
        stops: np.ndarray | None,
    ) -> None:
        """Finish on target_engine a request that started on spec_engine, from the prompt plus the
        tokens already streamed; its responses report `reason` and `stats` from here on."""
        out.route, out.reason, out.stats = "baseline", reason, stats
        self._run("target_engine", llm, d, prompt + out.ids, stops, lambda tokens, _: out.send(tokens, stats), cancel, already=len(out.ids))

    def _engine_request(
        self, engine: str, llm: LLMRequest, d: Decision, ids: list[int], stops: np.ndarray | None, max_tokens: int, stream: bool, key: str | None
    ) -> Any:
        arrays = engine_inputs(
            ids, max_tokens, self.end_id, temperature=llm.temperature, top_k=llm.top_k, top_p=llm.top_p,
            seed=llm.seed, streaming=stream, stop_words=stops,
        )
        params: dict[str, Any] = {}
        if key is not None:
            params[PARAM_REQUEST_KEY] = key
        if engine == "spec_engine":
            params[PARAM_ALGORITHM] = d.algorithm
            if d.num_speculative_tokens is not None:  # else the engine's default for the algorithm
                params[PARAM_NUM_SPEC_TOKENS] = int(d.num_speculative_tokens)
        return _bls_request(engine, arrays, self.outputs, params)

    def _run(
        self,
        engine: str,
        llm: LLMRequest,
        d: Decision,
        ids: list[int],
        stops: np.ndarray | None,
        on_tokens: Callable[[list[int], SpecStats], None],
        cancel: threading.Event,
        already: int = 0,
        stream: bool | None = None,
    ) -> SpecStats:
        """Run one engine request, passing each response's new tokens on; returns final stats.

        Raises InvalidInput for the client's mistakes, EngineFailure for the engine's, HandedOver
        when spec_engine stopped the request early at the gate's request, and Cancelled once
        `cancel` is set (after telling the engine to stop the request).
        """
        remaining = llm.max_tokens - already
        stats = SpecStats()
        if remaining <= 0:
            return stats
        # CPU engines understand cancel and ping messages (tensorrtllm does not; it runs in no stub)
        key = secrets.token_hex(8) if self.extensions else None
        req = self._engine_request(engine, llm, d, ids, stops, remaining, llm.stream if stream is None else stream, key)
        speculative = engine == "spec_engine"
        stall_s = self.gate.policy.speculative.stall_timeout_s if speculative else None
        probe = (lambda: self._control(engine, {PARAM_PING: True})) if self.extensions else None
        handed_over = False
        if speculative:
            self._count_speculating(+1)
        try:
            for batch in responses(req, engine, stall_s, cancel, probe):
                tokens: list[int] = []
                for resp in batch:
                    if resp.has_error():
                        err = resp.error()
                        code = err.code() if hasattr(err, "code") else None
                        # The gate validated every client-facing knob already, so spec_engine refusing a
                        # request (e.g. an algorithm it has not loaded) is a deployment fault: fall back.
                        if code == pb_utils.TritonError.INVALID_ARG and engine == "target_engine":
                            raise InvalidInput(err.message())
                        raise EngineFailure(f"{engine}: {err.message()}")
                    out = _out(resp, "output_ids")
                    if out is None:  # the flag-only final response
                        continue
                    stats = _stats(resp, stats)
                    tokens += [int(t) for t in out.reshape(-1)]
                    flag = _out(resp, "handed_over")
                    handed_over = handed_over or (flag is not None and bool(flag.reshape(-1)[0]))
                on_tokens(tokens, stats)
        except Cancelled:
            if key is not None:
                self._stop_engine_request(engine, key)
            raise
        except pb_utils.TritonModelException as exc:  # e.g. the engine is unloaded
            raise EngineFailure(f"{engine}: {exc}") from exc
        finally:
            if speculative:
                self._count_speculating(-1)
        if handed_over:
            raise HandedOver()
        return stats

    def _count_speculating(self, delta: int) -> None:
        with self._lock:
            self._speculating += delta

    def _control(self, engine: str, params: dict[str, Any]) -> None:
        """Send `engine` a control message (contract.PARAM_*); EngineFailure unless it answers in time."""
        arrays = engine_inputs([self.end_id], 1, self.end_id, streaming=False)
        req = _bls_request(engine, arrays, ["output_ids"], params)
        try:
            for batch in responses(req, engine, CONTROL_TIMEOUT_S):
                for resp in batch:
                    if resp.has_error():
                        raise EngineFailure(f"{engine} is not answering: {resp.error().message()}")
        except pb_utils.TritonModelException as exc:
            raise EngineFailure(f"{engine} is not answering: {exc}") from exc

    def _cancel(self, key: Any) -> None:
        """Postprocessing saw the client of request `key` cancel: stop serving it (see _run)."""
        try:
            key = int(key)
        except (TypeError, ValueError):
            return
        with self._lock:
            cancel = self._live.get(key)
        if cancel is not None:
            cancel.set()

    def _stop_engine_request(self, engine: str, key: str) -> None:
        try:
            self._control(engine, {PARAM_CANCEL: key})
        except EngineFailure as exc:  # it then runs to its end, unread
            log.warning("could not cancel a %s request: %s", engine, exc)

    def _hand_over(self) -> None:
        """Ask spec_engine to hand every running or queued request over (see the module doc)."""
        if not self._handing_over.acquire(blocking=False):
            return  # one is on its way; a later load decision sends the next
        try:
            self._control("spec_engine", {PARAM_HAND_OVER: True})
        except EngineFailure as exc:  # the requests then simply finish on spec_engine
            log.warning("hand-over to the baseline failed: %s", exc)
        finally:
            self._handing_over.release()

    # -- shadow ------------------------------------------------------------------------------------
    def _start_mirror(self, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None, cancel: threading.Event) -> Future:
        def mirror() -> tuple[list[int], SpecStats] | None:
            ids: list[int] = []
            try:
                stats = self._run("spec_engine", llm, d, prompt, stops, lambda t, s: ids.extend(t), cancel, stream=False)
            except (HandedOver, Cancelled):
                return None  # stopped early (under load, or its request was cancelled): nothing to compare
            return ids, stats

        return self.mirrors.submit(mirror)

    def _end_mirror(self, d: Decision, mirror: Future, served: list[int] | None) -> None:
        """Record the mirror's acceptance and, at T=0, whether it matched what was served."""
        try:
            result = mirror.result(timeout=600)
        except Exception as exc:
            log.warning("shadow mirror failed: %s", exc)
            self.gate.record_failure(d, "speculative")
            self.gate.end_shadow(d, None)
            return
        if result is None:
            self.gate.end_shadow(d, None)
            return
        ids, stats = result
        self.gate.record_speculative(d, stats)
        self.gate.end_shadow(d, None if served is None else ids != served)


class _Output:
    """The client-facing stream of one request: cumulative ids for postprocessing, route and stats.
    Every response carries the request's key, which postprocessing sends back if the client cancels."""

    def __init__(self, sender: Any, stream: bool, route: str, reason: str, key: int) -> None:
        self.sender, self.stream = sender, stream
        self.route, self.reason = route, reason
        self.key = key
        self.ids: list[int] = []
        self.prev = 0
        self.stats = SpecStats()

    def send(self, tokens: list[int], stats: SpecStats) -> None:
        self.ids += tokens
        self.stats = stats
        if self.stream and len(self.ids) > self.prev:
            self.sender.send(self._response(False))
            self.prev = len(self.ids)

    def finish(self) -> None:
        self.sender.send(self._response(True), flags=FINAL)

    def fail(self, error: Any) -> None:
        """Send `error` (an error response from triton_io) as the final response."""
        self.sender.send(error, flags=FINAL)

    def _response(self, final: bool) -> Any:
        s = self.stats
        return pb_utils.InferenceResponse(
            output_tensors=[
                tensor("output_ids", self.ids, np.int32),
                tensor("prev_output_length", [self.prev], np.int32),
                tensor("is_final", [final], np.bool_),
                tensor("route", [self.route.encode()], np.object_),
                tensor("gate_reason", [self.reason.encode()], np.object_),
                tensor("num_draft_tokens", [s.draft_tokens], np.int32),
                tensor("num_accepted_tokens", [s.accepted_tokens], np.int32),
                tensor("acceptance_rate", [s.acceptance_rate], np.float32),
                tensor("num_output_tokens", [len(self.ids)], np.int32),
                tensor("draft_budget", [s.draft_budget], np.int32),
                tensor(REQUEST_KEY_TENSOR, [self.key], np.int64),
            ]
        )
