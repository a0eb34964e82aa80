"""spec_gate's calls to the engine models over BLS: generation requests, and control messages.

One generation request streams its new tokens to a callback and ends with the engine's draft
statistics. Errors are sorted for the gate: InvalidInput when target_engine refuses the request as
invalid (the client's mistake), EngineRefused when spec_engine does (the gate serves it on the
baseline, which refuses it in turn if the client is at fault; neither counts against a breaker),
EngineFailure for the engine's failures (the gate falls back, and counts them), HandedOver when
spec_engine stopped the request at the gate's request, Cancelled when the client went away. Whenever
the gate stops reading a request the engine has not ended, it tells the engine to stop it, unless
the engine failed its ping (EngineGone: it could not hear the stop either).

CPU engines (`extensions`) also answer control messages (contract.PARAM_*): cancel a request by
key, ping, hand over; every request to them carries the engine key (serving/engine_key.py).
tensorrtllm runs in no Python stub and understands none of them.
"""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from specgate.contract import (
    ENGINE_EXTENSIONS,
    ENGINE_OUTPUTS,
    PARAM_ALGORITHM,
    PARAM_CANCEL,
    PARAM_CONTINUED,
    PARAM_HAND_OVER,
    PARAM_NUM_SPEC_TOKENS,
    PARAM_PING,
    PARAM_REQUEST_KEY,
    engine_inputs,
)
from specgate.errors import InvalidInput
from specgate.gate import Decision
from specgate.serving.bls import EngineFailure, Silent, responses
from specgate.serving.engine_key import EngineKey
from specgate.serving.llm_request import LLMRequest
from specgate.stats import SpecStats

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0  # an engine answers a control message at once; silence this long: it is gone


class HandedOver(Exception):
    """spec_engine stopped the request early, as the gate asked: continue it on the baseline."""


class EngineGone(EngineFailure):
    """A silent engine failed its ping: its process is dead or stuck, and hears no message."""


class EngineRefused(Exception):
    """spec_engine refused the request as invalid (INVALID_ARG): the client's mistake, or one of the
    deployment (an algorithm it has not loaded), never the engine failing."""


# How Triton and the Python backend say that a model's process is gone or the model is not loaded.
# Such a failure is worded "<engine> is not answering: ...", as a failed ping is, so that clients
# can tell an engine that is down (retry later) from one that failed on this request.
_GONE = ("is not healthy", "unknown model", "is not ready")


def _failure(engine: str, message: str) -> EngineFailure:
    gone = any(m in message for m in _GONE)
    return EngineFailure(f"{engine} is not answering: {message}" if gone else f"{engine}: {message}")


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class SharedPing:
    """Pings one engine for all of its silent requests: a caller that comes while a ping is in flight
    waits for that ping's answer instead of sending its own. Why: Triton hands an engine its messages
    one at a time, and to a dead stub each costs the Python backend's 1 s health check. N silent
    requests sent N pings (and then N stop messages) down that queue, and on a 2-core EPYC the last
    ping waited past CONTROL_TIMEOUT_S: its client heard "no response for 10 s", not that the engine
    was gone. A ping that heard nothing at all is sent once more: one handed to a stub as it was
    killed is never answered nor failed (Triton fails only the messages handed over after the death,
    seen on a slow 2-core EPYC: clients heard "no response for 10 s" 13 s after a kill that met the
    first ping), and the second fails within the health check. Raises EngineGone if the ping failed."""

    def __init__(self, ping: Callable[[], None]) -> None:
        self._ping = ping
        self._lock = threading.Lock()
        self._flight: _Flight | None = None

    def __call__(self) -> None:
        with self._lock:
            flight, mine = self._flight, self._flight is None
            if flight is None:
                flight = self._flight = _Flight()
        if mine:
            try:
                try:
                    self._ping()
                except Silent:
                    self._ping()
            except Exception as exc:  # every waiter raises it, each as an exception of its own
                flight.error = str(exc)
            finally:
                with self._lock:
                    self._flight = None
                flight.done.set()
        flight.done.wait()  # the ping itself is bounded by CONTROL_TIMEOUT_S
        if flight.error is not None:
            raise EngineGone(flight.error)


def _out(resp: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()


class EngineClient:
    def __init__(self, end_id: int, extensions: bool, stall_timeout_s: Callable[[], float], key: EngineKey | None = None) -> None:
        """`key`: the engine key every request carries (CPU engines, `extensions`; tensorrtllm checks none)."""
        self.end_id, self.extensions, self.stall_timeout_s = end_id, extensions, stall_timeout_s
        self.key = key if extensions else None
        self.outputs = [t.name for t in ENGINE_OUTPUTS] + ([t.name for t in ENGINE_EXTENSIONS] if extensions else [])
        self._lock = threading.Lock()
        self._speculating = 0  # requests (and mirrors) now on spec_engine
        self._handing_over = threading.Lock()  # at most one hand-over message in flight
        # Stop messages for requests the gate gave up on, sent off the request's thread: an engine
        # that is gone makes each wait CONTROL_TIMEOUT_S, and the client must not wait with it.
        self._stopper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-stop")
        self._pings: dict[str, SharedPing] = {}  # engine -> its shared ping

    @property
    def speculating(self) -> int:
        return self._speculating

    def run(
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
        movable: bool = True,
    ) -> SpecStats:
        """Run one engine request for the rest of `llm`'s max_tokens (`already` emitted), passing
        each response's new tokens on; returns the final stats. `movable` False: a request on
        spec_engine that the baseline cannot take (its engine failed), not counted in `speculating`,
        so that it triggers no hand-over. Raises as the module doc says."""
        remaining = llm.max_tokens - already
        stats = SpecStats()
        if remaining <= 0:
            return stats
        key = secrets.token_hex(8) if self.extensions else None
        req = self._request(engine, llm, d, ids, stops, remaining, llm.stream if stream is None else stream, key, already)
        speculative = engine == "spec_engine"
        stall_s = self.stall_timeout_s() if speculative else None
        probe = self._shared_ping(engine) if self.extensions else None
        handed_over = ended = False  # ended: the engine finished the request or cannot hear a stop
        counted = speculative and movable
        if counted:
            self._count_speculating(+1)
        try:
            for batch in responses(req, engine, stall_s, cancel, probe):
                tokens: list[int] = []
                for resp in batch:
                    if resp.has_error():
                        ended = True
                        if tokens:  # what came before the error is output: a continuation starts after it
                            on_tokens(tokens, stats)
                        err = resp.error()
                        code = err.code() if hasattr(err, "code") else None
                        if code == pb_utils.TritonError.INVALID_ARG:  # a refusal, not a failure
                            raise InvalidInput(err.message()) if engine == "target_engine" else EngineRefused(f"{engine}: {err.message()}")
                        raise _failure(engine, err.message())
                    out = _out(resp, "output_ids")
                    if out is None:  # the flag-only final response
                        continue
                    stats = SpecStats.from_response(lambda name: _out(resp, name), stats)
                    tokens += [int(t) for t in out.reshape(-1)]
                    flag = _out(resp, "handed_over")
                    handed_over = handed_over or (flag is not None and bool(flag.reshape(-1)[0]))
                on_tokens(tokens, stats)
            ended = True
        except EngineGone:
            ended = True
            raise
        except pb_utils.TritonModelException as exc:  # e.g. the engine is unloaded
            raise _failure(engine, str(exc)) from exc
        finally:
            if counted:
                self._count_speculating(-1)
            if not ended and key is not None:  # cancelled, stalled, or the gate failed: no one reads it
                self._stopper.submit(self._stop, engine, key)
        if handed_over:
            raise HandedOver()
        return stats

    def control(self, engine: str, params: dict[str, Any]) -> None:
        """Send `engine` a control message (contract.PARAM_*); EngineFailure unless it answers in time."""
        arrays = engine_inputs([self.end_id], 1, self.end_id, streaming=False)
        req = self._bls_request(engine, arrays, ["output_ids"], params)
        try:
            for batch in responses(req, engine, CONTROL_TIMEOUT_S):
                for resp in batch:
                    if resp.has_error():
                        raise EngineFailure(f"{engine} is not answering: {resp.error().message()}")
        except Silent:  # alive or not, it is hung: as much "not answering" as a dead stub (a retry elsewhere may serve)
            raise Silent(f"{engine} is not answering: no answer to a control message in {CONTROL_TIMEOUT_S:g} s") from None
        except pb_utils.TritonModelException as exc:
            raise EngineFailure(f"{engine} is not answering: {exc}") from exc

    def _shared_ping(self, engine: str) -> SharedPing:
        with self._lock:
            if engine not in self._pings:
                self._pings[engine] = SharedPing(lambda: self.control(engine, {PARAM_PING: True}))
            return self._pings[engine]

    def shutdown(self) -> None:
        self._stopper.shutdown(wait=False, cancel_futures=True)

    def hand_over(self) -> None:
        """Ask spec_engine to hand every running or queued request over to the baseline."""
        if not self._handing_over.acquire(blocking=False):
            return  # one is on its way; a later load decision sends the next
        try:
            self.control("spec_engine", {PARAM_HAND_OVER: True})
        except EngineFailure as exc:  # the requests then simply finish on spec_engine
            log.warning("hand-over to the baseline failed: %s", exc)
        finally:
            self._handing_over.release()

    def _request(
        self, engine: str, llm: LLMRequest, d: Decision, ids: list[int], stops: np.ndarray | None, max_tokens: int, stream: bool,
        key: str | None, already: int,
    ) -> Any:
        arrays = engine_inputs(
            ids, max_tokens, self.end_id, temperature=llm.temperature, top_k=llm.top_k, top_p=llm.top_p,
            seed=llm.seed, streaming=stream, stop_words=stops,
        )
        params: dict[str, Any] = {}
        if key is not None:
            params[PARAM_REQUEST_KEY] = key
        if already and stops is not None and self.extensions:  # a stop word may span the output so far
            params[PARAM_CONTINUED] = already
        if engine == "spec_engine":
            params[PARAM_ALGORITHM] = d.algorithm
            if d.num_speculative_tokens is not None:  # else the engine's default for the algorithm
                params[PARAM_NUM_SPEC_TOKENS] = int(d.num_speculative_tokens)
        return self._bls_request(engine, arrays, self.outputs, params)

    def _bls_request(self, engine: str, arrays: dict[str, np.ndarray], outputs: list[str], params: dict[str, Any]) -> Any:
        """A BLS request to an engine model from `contract.engine_inputs` arrays, with the engine key."""
        inputs = [pb_utils.Tensor(name, arr) for name, arr in arrays.items()]
        params = params if self.key is None else self.key.stamp(params)
        return pb_utils.InferenceRequest(model_name=engine, inputs=inputs, requested_output_names=outputs, parameters=params)

    def _stop(self, engine: str, key: str) -> None:
        try:
            self.control(engine, {PARAM_CANCEL: key})
        except EngineFailure as exc:  # it then runs to its end, unread
            log.warning("could not cancel a %s request: %s", engine, exc)

    def _count_speculating(self, delta: int) -> None:
        with self._lock:
            self._speculating += delta
