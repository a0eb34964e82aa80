"""Triton adapter for `spec_gate`: decide the route, forward over BLS, stream back, record metrics.

Every request is served on a worker thread so the decoupled `execute` returns at once and many
requests stream concurrently, as many as the admission queue lets in (specgate.gate.admission;
past it: UNAVAILABLE "overloaded"). The policy itself lives in `specgate.gate` (tested without
Triton). Beside this module: `gate_parsing` (what a request says), `engine_client` (the BLS calls
to the engines and their control messages), `shadow` (mirrors), `client_stream` (the responses).

Failure handling: if `spec_engine` fails or is unavailable, the request continues on
`target_engine` from the tokens already streamed (prompt + emitted ids), so the client sees no
error, and the failure is counted (repeated failures open the tenant's circuit). If `target_engine`
fails, the request continues the same way on `spec_engine`, which drafts only what pays (nothing,
where verification is dear): one dead engine process loses no request. Only when both fail does
the client get an error.

Hand-over under load: when the load rule sends a request to the baseline while speculative
requests are running, the gate asks spec_engine (CPU engines only) to hand them over; each then
continues on the batched baseline the same way, with reason `load`. Otherwise a speculative request
that started alone keeps the one-at-a-time engine busy beside the batch, and both slow down.

Cancellation and dead engines (CPU engines only; docs/robustness.md): each response carries the
request's key, which postprocessing sends back when the client has cancelled; the gate then stops
the request and tells its engines to stop it too. While an engine is silent the gate sends
postprocessing heartbeats, so that this also works for a non-streamed request. An engine request
that stays silent is checked with a ping, so a dead engine process fails the request instead of
hanging it, and a slow one that answers is left to finish.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from specgate.contract import PARAM_CANCEL
from specgate.errors import InvalidInput
from specgate.gate import Decision, Gate, PolicyError
from specgate.gate.admission import Overloaded, Ticket
from specgate.gate.labels import label_secret_from_env
from specgate.gate.policy import MAX_CONCURRENT_CAP, MAX_QUEUED_CAP
from specgate.gate.decision import LOAD  # also the reason of a speculative request handed over
from specgate.serving.bls import Cancelled, EngineFailure
from specgate.serving.client_stream import ClientStream
from specgate.serving.engine_client import EngineClient, EngineRefused, HandedOver
from specgate.serving.engine_key import EngineKey
from specgate.serving.gate_parsing import parse_gate_request, prompt_ids, stop_words
from specgate.serving.live_requests import LiveRequests
from specgate.serving.llm_request import LLMRequest
from specgate.serving.parent_watch import watch_parent
from specgate.serving.shadow import Shadow
from specgate.serving.triton_io import FINAL, RequestedOutputsSender, error_response, request_parameters, unavailable_response
from specgate.stats import SpecStats

import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

FALLBACK = "spec_engine_failure"  # gate_reason when a speculative request finished on baseline
TARGET_FALLBACK = "target_engine_failure"  # ... when a baseline request finished on spec_engine


class _CancelFlag(threading.Event):
    """Set when the request's client cancelled: what EngineClient.run watches, and what
    LiveRequests cancels by key."""

    def cancel(self) -> None:
        self.set()


class GateModel:
    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        watch_parent()
        p = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.max_output_len = int(p["max_output_len"])
        self.max_input_len = int(p["max_input_len"])
        self.vocab_size = int(p["vocab_size"]) if p.get("vocab_size") else None
        self.extensions = p["engine_extensions"] == "true"
        self.key = EngineKey.from_env()  # on every engine request; every cancel message must carry it
        self.gate = Gate(
            p["policy_path"], metric_factory=pb_utils, label_secret=label_secret_from_env(), calibration_path=p.get("calibration_path") or None
        )
        self.engines = EngineClient(int(p["end_id"]), self.extensions, lambda: self.gate.policy.speculative.stall_timeout_s, self.key)
        self.shadow = Shadow(self.gate, self.engines)
        # One thread per admitted or queued request (the admission queue bounds them), plus the
        # hand-over message; threads start only as needed.
        self.pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CAP + MAX_QUEUED_CAP + 1, thread_name_prefix="gate")
        self.live = LiveRequests()  # request key -> its cancel flag

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = RequestedOutputsSender(request)
            ticket = decision = None
            try:
                params = request_parameters(request)
                if PARAM_CANCEL in params:  # postprocessing: the client of this key cancelled
                    self.key.check(params, "spec_gate")  # only our postprocessing may cancel
                    self._cancel(params[PARAM_CANCEL])
                    sender.send(flags=FINAL)
                    continue
                # the prompt's size first: it bounds the work of everything after
                prompt, stops = prompt_ids(request, self.vocab_size, self.max_input_len), stop_words(request)
                llm = parse_gate_request(request, params, self.max_output_len, prompt)
                ticket = self.gate.admission.enter()
                decision = self.gate.decide(llm)
                self.pool.submit(self._serve, sender, llm, decision, prompt, stops, ticket)
                if decision.reason == LOAD and self.extensions and self.engines.speculating:
                    self.pool.submit(self.engines.hand_over)
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
        self.shadow.shutdown()
        self.engines.shutdown()

    def _serve(self, sender: Any, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None, ticket: Ticket) -> None:
        key = secrets.randbits(63)
        out = ClientStream(sender, llm.stream, d.route, d.reason, key)
        cancel = _CancelFlag()
        self.live.add(str(key), cancel)

        def queued() -> None:
            """While queued for admission: a client that left gives up its place. The gate hears of it
            through postprocessing, which looks at heartbeats: without them a departed client held its
            place until admitted or timed out, and live clients were refused meanwhile."""
            if cancel.is_set():
                raise Cancelled()
            out.heartbeat()

        try:
            try:
                self.gate.admission.wait(ticket, queued)
            except (Overloaded, Cancelled):
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
            out.fail("cancelled", "cancelled by the client")
        except Overloaded as exc:
            out.fail("unavailable", str(exc))
        except (EngineFailure, InvalidInput) as exc:
            out.fail("invalid_arg" if isinstance(exc, InvalidInput) else "internal", str(exc))
        except Exception as exc:  # never leave a client without a final response
            log.exception("gate failed")
            out.fail("internal", f"gate error: {exc}")
        finally:
            self.live.discard(str(key))
            self.gate.admission.leave(ticket)
            self.gate.finish(d)

    def _serve_speculative(
        self, out: ClientStream, cancel: threading.Event, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None
    ) -> None:
        try:
            stats = self.engines.run("spec_engine", llm, d, prompt, stops, out.send, cancel, on_idle=out.heartbeat)
            self.gate.record_speculative(d, stats)
        except HandedOver:
            self.gate.record_speculative(d, out.stats)
            # the response keeps reporting the drafts made before the hand-over
            self._continue_on_baseline(out, cancel, LOAD, out.stats, llm, d, prompt, stops)
        except EngineRefused as exc:  # not a failure of the engine: the breaker does not hear of it
            log.warning("spec_engine refused the request, serving it on target_engine: %s", exc)
            self._continue_on_baseline(out, cancel, FALLBACK, SpecStats(), llm, d, prompt, stops)
        except EngineFailure as exc:
            log.warning("spec_engine failed, continuing on target_engine: %s", exc)
            self.gate.record_failure(d, "speculative")
            self._continue_on_baseline(out, cancel, FALLBACK, SpecStats(), llm, d, prompt, stops)

    def _serve_baseline(
        self, out: ClientStream, cancel: threading.Event, llm: LLMRequest, d: Decision, prompt: list[int], stops: np.ndarray | None
    ) -> None:
        mirror = self.shadow.start(llm, d, prompt, stops, cancel) if d.shadow else None
        served: list[int] | None = None  # what the mirror is compared with: nothing unless served at T=0 on the baseline
        try:
            try:
                self.engines.run("target_engine", llm, d, prompt, stops, out.send, cancel, on_idle=out.heartbeat)
                served = out.ids if llm.temperature == 0 else None
            except EngineFailure as exc:
                self.gate.record_failure(d, "baseline")
                log.warning("target_engine failed, continuing on spec_engine: %s", exc)
                self._continue_on_speculative(out, cancel, exc, llm, d, prompt, stops)
        finally:  # whatever ended the request, its mirror slot is freed once the mirror ends
            if mirror is not None:
                self.shadow.end(d, mirror, served)

    def _continue_on_speculative(
        self, out: ClientStream, cancel: threading.Event, failure: EngineFailure, llm: LLMRequest, d: Decision, prompt: list[int],
        stops: np.ndarray | None,
    ) -> None:
        """Finish on spec_engine a request whose target_engine failed, from the prompt plus the tokens
        already streamed. Not a speculative sample: the breaker hears nothing of it. Nor is it
        counted as speculating, so it triggers no hand-over to the baseline, and one that another
        request triggered keeps it on spec_engine, the baseline being down; if spec_engine cannot
        serve it either (it failed, or refused an algorithm it has not loaded), the client hears of
        the baseline's failure, which is what went wrong first."""
        out.route, out.reason = "speculative", TARGET_FALLBACK
        while True:
            try:
                self.engines.run(
                    "spec_engine", llm, d, prompt + out.ids, stops, out.send, cancel, already=len(out.ids), on_idle=out.heartbeat,
                    movable=False,
                )
                return
            except HandedOver:
                continue
            except (EngineRefused, EngineFailure) as exc:
                log.warning("spec_engine could not finish it either: %s", exc)
                raise failure from exc

    def _continue_on_baseline(
        self, out: ClientStream, cancel: threading.Event, reason: str, stats: SpecStats, llm: LLMRequest, d: Decision, prompt: list[int],
        stops: np.ndarray | None,
    ) -> None:
        """Finish on target_engine a request that started on spec_engine, from the prompt plus the
        tokens already streamed; its responses report `reason` and `stats` from here on."""
        out.route, out.reason, out.stats = "baseline", reason, stats
        self.engines.run(
            "target_engine", llm, d, prompt + out.ids, stops, lambda tokens, _: out.send(tokens, stats), cancel, already=len(out.ids), on_idle=out.heartbeat
        )

    def _cancel(self, key: Any) -> None:
        """Postprocessing saw the client of request `key` cancel: stop serving it (EngineClient.run
        then stops its engine request)."""
        try:
            key = int(key)
        except (TypeError, ValueError):
            return
        live = self.live.cancel(str(key))
        # one line per cancelled request: the trail of a cancellation that did not stop its engine
        log.info("client cancelled request %x: %s", key, "stopping it" if live else "not running (yet): stopped if it comes")
