"""Triton adapter for `spec_gate`: read the request, decide the route, forward over BLS, stream the
client's text back, record metrics.

spec_gate is two steps of the `llm` ensemble (contract.GATE_TICK; docs/request-flow.md has the whole
path on one page):
- the intake reads and checks the request (a bad one is refused there) and answers with its key;
- that answer schedules the serving step: admission, the decision, and the responses the client
  sees, which the gate detokenizes itself and sends through its one `Outbox` thread
  (serving/client_stream.py). Each request is served on a worker thread, so the decoupled `execute`
  returns at once and many requests stream concurrently, as many as the admission queue lets in
  (specgate.gate.admission; past it: UNAVAILABLE "overloaded");
- meanwhile the intake sends ticks, each a short serving step that only asks Triton whether the
  client cancelled (serving/watch.py); a cancelled one stops the request and its engine request.
A direct caller of spec_gate (no ensemble; it asks for the client's outputs, not the tick) is served
on its own request, without ticks.

The policy itself lives in `specgate.gate` (tested without Triton). Beside this module:
`gate_parsing` (what a request says), `engine_client` (the BLS calls to the engines and their control
messages), `shadow` (mirrors), `client_stream` (the responses), `watch` (the ticks).

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

Dead engines (CPU engines only; docs/robustness.md): an engine request that stays silent is checked
with a ping, so a dead engine process fails the request instead of hanging it, and a slow one that
answers is left to finish.

The gate answers a ping too (contract.PARAM_PING, with the engine key): `make serve`'s supervisor
sends one every few seconds, and a gate whose Python stopped (Triton's lock-order hang,
docs/robustness.md "Limits") answers none and has its server restarted.
"""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import triton_python_backend_utils as pb_utils
from pydantic import BaseModel

from specgate.contract import GATE_TICK, PARAM_PING
from specgate.errors import InvalidInput
from specgate.gate import Gate, PolicyError, Route
from specgate.gate.admission import Overloaded
from specgate.gate.decision import LOAD  # also the reason of a speculative request handed over
from specgate.gate.labels import label_secret_from_env
from specgate.gate.policy import MAX_CONCURRENT_CAP, MAX_QUEUED_CAP
from specgate.serving.bls import Cancelled, EngineFailure
from specgate.serving.client_stream import ClientStream
from specgate.serving.engine_client import EngineClient, EngineRefused, HandedOver
from specgate.serving.engine_key import EngineKey
from specgate.serving.gate_parsing import parse_gate_request, prompt_ids, stop_words
from specgate.serving.outbox import Outbox
from specgate.serving.parent_watch import watch_parent
from specgate.serving.request_context import RequestContext
from specgate.serving.shadow import Shadow
from specgate.serving.triton_io import (
    FINAL,
    RequestedOutputsSender,
    error_response,
    model_parameters,
    optional_array,
    request_parameters,
    unavailable_response,
)
from specgate.serving.watch import Watches, tick_response
from specgate.stats import SpecStats
from specgate.text.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

FALLBACK = "spec_engine_failure"  # gate_reason when a speculative request finished on baseline
TARGET_FALLBACK = "target_engine_failure"  # ... when a baseline request finished on spec_engine


class GateParameters(BaseModel):
    """spec_gate's config.pbtxt parameters (build/render_repository.py fills them)."""

    policy_path: str
    calibration_path: str = ""  # spec_engine's published calibration; empty: route on the policy alone
    tokenizer_dir: str
    max_output_len: int
    max_input_len: int
    vocab_size: int | None = None  # None: not known (tensorrtllm); only negative ids are refused
    end_id: int
    engine_extensions: bool  # the CPU engines' extra outputs and control messages


class GateModel:
    def initialize(self, args: dict[str, str]) -> None:
        logging.basicConfig(level=logging.INFO)
        watch_parent()
        p = model_parameters(args, GateParameters)
        self.max_output_len, self.max_input_len, self.vocab_size = p.max_output_len, p.max_input_len, p.vocab_size
        self.extensions = p.engine_extensions
        self.gate = Gate(p.policy_path, metric_factory=pb_utils, label_secret=label_secret_from_env(),
                         calibration_path=p.calibration_path or None)
        self.key = EngineKey.from_env()
        self.engines = EngineClient(p.end_id, self.extensions, lambda: self.gate.policy.speculative.stall_timeout_s, self.key)
        self.shadow = Shadow(self.gate, self.engines)
        self.decoder = PromptTokenizer(p.tokenizer_dir, 1, chat=False)  # it only decodes
        self.outbox = Outbox("gate-outbox")
        self.watches = Watches()
        # One thread per admitted or queued request (the admission queue bounds them), plus the
        # hand-over message; threads start only as needed.
        self.pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CAP + MAX_QUEUED_CAP + 1, thread_name_prefix="gate")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            tick = optional_array(request, GATE_TICK.name)
            try:
                if tick is None:
                    self._intake(request)
                else:
                    key, n = (int(v) for v in tick.reshape(-1)[:2])
                    (self._serving_step if n == 0 else self._tick)(request, key)
            except Exception as exc:  # never leave a step without its final response
                log.exception("gate step failed")
                RequestedOutputsSender(request).send(error_response(f"gate error: {exc}", invalid_arg=False), flags=FINAL)
        return None

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.watches.shutdown()
        self.outbox.shutdown()
        self.shadow.shutdown()
        self.engines.shutdown()

    # -- the steps ---------------------------------------------------------------------------------
    def _intake(self, request: Any) -> None:
        """Read and check the request: a bad one is refused here, while no other step of it runs.
        Through the ensemble, answer with its key (n = 0), which schedules the serving step; a
        direct caller is served on this request."""
        sender = RequestedOutputsSender(request)
        try:
            params = request_parameters(request)
            if params.get(PARAM_PING):  # the supervisor: does the gate's Python still run? (answering is the answer)
                self.key.check(params, "spec_gate")
                sender.send(flags=FINAL)
                return
            # the prompt's size first: it bounds the work of everything after
            prompt, stops = prompt_ids(request, self.vocab_size, self.max_input_len), stop_words(request)
            ctx = RequestContext(parse_gate_request(request, params, self.max_output_len, prompt), prompt, stops, secrets.randbits(63))
        except InvalidInput as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return
        if sender.wanted == {GATE_TICK.name}:  # the ensemble's intake step asks for nothing else
            self.watches.open(ctx.key, sender, ctx)
            sender.send(tick_response(ctx.key, 0))
        else:
            self._admit(ctx, sender)

    def _serving_step(self, request: Any, key: int) -> None:
        """The step whose responses are the client's."""
        sender = RequestedOutputsSender(request)
        ctx = self.watches.serving(key)
        if not isinstance(ctx, RequestContext):  # its intake was closed (it waited too long), or a forged key
            sender.send(error_response(f"gate error: no request {key:x} to serve", invalid_arg=False), flags=FINAL)
            return
        if sender.is_cancelled():  # the client left before this step was scheduled (one IPC a request)
            ctx.cancel()
        self._admit(ctx, sender)

    def _tick(self, request: Any, key: int) -> None:
        """Did the client cancel? Answered at once; asked first (after the final flag the request is gone)."""
        cancelled = request.is_cancelled()
        request.get_response_sender().send(flags=FINAL)
        self.watches.answered(key, cancelled)

    def _admit(self, ctx: RequestContext, sender: Any) -> None:
        """Admission and the decision, then serve on a worker thread. A refusal ends the intake first
        (an error while another step of the request runs would leave it in flight: serving/watch.py)."""
        ticket = decision = None
        try:
            ticket = self.gate.admission.enter()
            decision = self.gate.decide(ctx.llm)
        except Exception as exc:
            if ticket is not None:
                self.gate.admission.leave(ticket)
            self.watches.close(ctx.key)
            if isinstance(exc, Overloaded):
                sender.send(unavailable_response(str(exc)), flags=FINAL)
            elif isinstance(exc, PolicyError):
                sender.send(error_response(str(exc)), flags=FINAL)
            else:
                log.exception("could not start request")
                sender.send(error_response(f"gate error: {exc}", invalid_arg=False), flags=FINAL)
            return
        ctx.admit(decision, ticket, ClientStream(sender, ctx.llm.stream, decision.route, decision.reason, self.decoder, self.outbox))
        self.pool.submit(self._serve, ctx)
        if decision.reason == LOAD and self.extensions and self.engines.speculating:
            self.pool.submit(self.engines.hand_over)

    # -- serving -----------------------------------------------------------------------------------
    def _serve(self, ctx: RequestContext) -> None:
        d, out = ctx.decision, ctx.out
        error: tuple[str, str] | None = None
        try:
            try:
                self.gate.admission.wait(ctx.ticket, ctx.check_cancelled)
            except (Overloaded, Cancelled):
                if d.shadow:
                    self.gate.end_shadow(d, None)  # its mirror never started
                raise
            if d.route is Route.SPECULATIVE:
                self._serve_speculative(ctx)
            else:
                self._serve_baseline(ctx)
        except Cancelled:  # no acceptance sample: a reply's first tokens are not a fair one
            self.gate.record_cancelled()
            error = ("cancelled", "cancelled by the client")
        except Overloaded as exc:
            error = ("unavailable", str(exc))
        except (EngineFailure, InvalidInput) as exc:
            error = ("invalid_arg" if isinstance(exc, InvalidInput) else "internal", str(exc))
        except Exception as exc:  # never leave a client without a final response
            log.exception("gate failed")
            error = ("internal", f"gate error: {exc}")
        finally:
            self.gate.admission.leave(ctx.ticket)
            self.gate.finish(d)
        try:
            self.watches.close(ctx.key, drain=error is not None)
            if error is None:
                out.finish()
            else:
                out.fail(*error)
        except Exception:  # the client is gone
            log.warning("could not send a request's last response", exc_info=True)

    def _serve_speculative(self, ctx: RequestContext) -> None:
        d, out = ctx.decision, ctx.out
        try:
            stats = self.engines.run(Route.SPECULATIVE.engine, ctx.llm, d, ctx.prompt, ctx.stops, out.send, ctx.cancelled)
            self.gate.record_speculative(d, stats)
        except HandedOver:
            self.gate.record_speculative(d, out.stats)
            # the response keeps reporting the drafts made before the hand-over
            self._continue_on_baseline(ctx, LOAD, out.stats)
        except EngineRefused as exc:  # not a failure of the engine: the breaker does not hear of it
            log.warning("spec_engine refused the request, serving it on target_engine: %s", exc)
            self._continue_on_baseline(ctx, FALLBACK, SpecStats())
        except EngineFailure as exc:
            log.warning("spec_engine failed, continuing on target_engine: %s", exc)
            self.gate.record_failure(d, Route.SPECULATIVE)
            self._continue_on_baseline(ctx, FALLBACK, SpecStats())

    def _serve_baseline(self, ctx: RequestContext) -> None:
        d, out = ctx.decision, ctx.out
        mirror = self.shadow.start(ctx.llm, d, ctx.prompt, ctx.stops, ctx.cancelled) if d.shadow else None
        served: list[int] | None = None  # what the mirror is compared with: nothing unless served at T=0 on the baseline
        try:
            try:
                self.engines.run(Route.BASELINE.engine, ctx.llm, d, ctx.prompt, ctx.stops, out.send, ctx.cancelled)
                served = out.ids if ctx.llm.temperature == 0 else None
            except EngineFailure as exc:
                self.gate.record_failure(d, Route.BASELINE)
                log.warning("target_engine failed, continuing on spec_engine: %s", exc)
                self._continue_on_speculative(ctx, exc)
        finally:  # whatever ended the request, its mirror slot is freed once the mirror ends
            if mirror is not None:
                self.shadow.end(d, mirror, served)

    def _continue_on_speculative(self, ctx: RequestContext, failure: EngineFailure) -> None:
        """Finish on spec_engine a request whose target_engine failed, from the prompt plus the tokens
        already streamed. Not a speculative sample: the breaker hears nothing of it. Nor is it
        counted as speculating, so it triggers no hand-over to the baseline, and one that another
        request triggered keeps it on spec_engine, the baseline being down; if spec_engine cannot
        serve it either (it failed, or refused an algorithm it has not loaded), the client hears of
        the baseline's failure, which is what went wrong first."""
        out = ctx.out
        out.reroute(Route.SPECULATIVE, TARGET_FALLBACK)
        while True:
            try:
                self.engines.run(
                    Route.SPECULATIVE.engine, ctx.llm, ctx.decision, ctx.continuation(), ctx.stops, out.send, ctx.cancelled,
                    already=len(out.ids), movable=False,
                )
                return
            except HandedOver:
                continue
            except (EngineRefused, EngineFailure) as exc:
                log.warning("spec_engine could not finish it either: %s", exc)
                raise failure from exc

    def _continue_on_baseline(self, ctx: RequestContext, reason: str, stats: SpecStats) -> None:
        """Finish on target_engine a request that started on spec_engine, from the prompt plus the
        tokens already streamed; its responses report `reason` and `stats` from here on."""
        out = ctx.out
        out.reroute(Route.BASELINE, reason, stats)
        self.engines.run(
            Route.BASELINE.engine, ctx.llm, ctx.decision, ctx.continuation(), ctx.stops, lambda tokens, _: out.send(tokens, stats),
            ctx.cancelled, already=len(out.ids),
        )

