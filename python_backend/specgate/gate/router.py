"""Per-request routing: which engine serves a request, and the outcome reports that feed back.

Mode precedence (first that is set wins):
    1. `x-speculative-decoding` request parameter (header / body field): off | shadow | prod
    2. `use_speculative_decoding` BOOL input: true -> prod, false -> off
    3. the tenant's `mode` (tenant found by its `x-api-key` in the key file)
    4. the org `mode`
1 and 2 are request overrides: honoured only where `allow_override` (tenant, else org) is true,
otherwise ignored and counted in spec_gate_override_ignored_total{tenant}.

Then the rules, in this order; the first that applies names the reason:

    mode off                                   -> baseline     mode_off
    temperature > threshold                    -> baseline     temperature
    spec_engine measuring (no calibration yet) -> baseline     calibrating  (cost_model/route.py)
    prod from policy, hash(request) > canary   -> baseline     canary_out
    in flight >= load.max_in_flight            -> baseline     load
    prod from policy, drafting cannot pay here -> baseline     no_gain      (spec_engine's calibration)
    prod from policy, a tenant with no evidence
      where the curve expects no gain at the
      prior acceptance, not a probe            -> baseline     no_gain      (its breaker starts half-open)
    breaker open (or half-open, not a probe)   -> baseline     circuit_open
    prod from policy, the curve expects less
      than min_gain at the tenant's acceptance:
      one in probe_fraction                    -> speculative  gain_probe   (keeps measuring it)
      the others                               -> baseline     no_gain
    shadow, a mirror slot is free              -> baseline     shadow       (shadow=True: mirror it)
    shadow, all mirror slots busy              -> baseline     shadow_busy  (dropped, not queued)
    prod, breaker half-open, chosen as a probe -> speculative  half_open_probe
    prod, canary_percent < 100 and inside it   -> speculative  canary_in
    prod                                       -> speculative  prod

A tenant with no evidence of its own is judged by the prior: where the calibration expects drafting
at the algorithm's prior acceptance to buy less than `breaker.min_gain`, the tenant's breaker starts
half-open, so a fraction of its requests probe (half_open_probe) and the rest go to the baseline
(no_gain) until the probes' verdict; the breaker takes it from there. A tenant with evidence (its
acceptance EMA over `breaker.min_samples` requests, or what spec_engine modelled its requests to
have bought, kept apart per prompt-length class: breaker.py) is judged the same way on its own
evidence, request by request: where that says less
than `min_gain`, only one request in `probe_fraction` goes speculative (gain_probe), so the EMAs
keep following the tenant, and the rest go to the baseline (no_gain). The breaker opens only below break-even (a gain of 1); between
break-even and `min_gain` the route costs its own overhead for a gain too small to count on.

Where a tenant has no evidence for a request's prompt class but all tenants' requests of that class
on its algorithm bought `min_gain` (gate/fleet.py, over `probe_samples` of them), the request is
judged paying: a new tenant's long prompts go speculative at once where others' long prompts have
shown prompt lookup paying. That evidence only admits; it never holds a tenant back.

The canary and `no_gain` apply only when `prod` comes from policy (tenant or org): a request that
asks for `prod` itself has opted in (spec_engine then still drafts only what pays, down to nothing).

The algorithm is the request's, the tenant's or the policy's; `auto` (the shipped default) is the one
spec_engine's calibration expects fastest at the tenant's acceptance (cost_model/route.py). With a
calibration the gate refuses algorithms the engine does not have, and `auto` breaker thresholds are
the acceptance below which the decision's algorithm stops paying on this machine. A malformed
`x-speculative-decoding` raises `PolicyError` (policy `malformed_header: reject`, the default) or is
ignored (`ignore`), whether or not the tenant may override. An unknown or missing `x-api-key` gets
the org settings and shares the org breaker, label `org` (`unknown_tenant: org_default`, the
default) or raises `PolicyError` (`reject`). A key is never logged, exported or echoed in an error.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.calibration import Calibration
from specgate.cost_model.route import CalibrationStore, breaker_thresholds, can_pay, pays
from specgate.gate.admission import AdmissionQueue
from specgate.gate.breaker import Admission, BreakerState, CircuitBreakers
from specgate.gate.decision import (
    CALIBRATING,
    CANARY_IN,
    CANARY_OUT,
    CIRCUIT_OPEN,
    GAIN_PROBE,
    HALF_OPEN_PROBE,
    LOAD,
    MODE_OFF,
    NO_GAIN,
    PROD,
    ROUTE_OF,
    SHADOW,
    SHADOW_BUSY,
    TEMPERATURE,
    Decision,
    GateRequest,
    GateStats,
    Route,
    RouteResult,
)
from specgate.gate.fleet import FleetGains
from specgate.gate.labels import TenantLabels
from specgate.gate.metrics import GateMetrics
from specgate.gate.policy import FALLBACK_CLOSE, FALLBACK_OPEN, BreakerPolicy, Loaded, Mode, Policy, PolicyStore, TenantPolicy
from specgate.gate.request_rules import in_canary, requested_mode, setting, speculation, tenant_of
from specgate.gate.tenants import ORG

log = logging.getLogger(__name__)

# The deepest draft position any algorithm reaches (a chain's k, a tree's depth): position series.
MAX_POSITIONS = max(a.depth(a.max_k) for a in ALGORITHMS.values())
_CIRCUIT_GAUGE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 0.5, BreakerState.OPEN: 1.0}


def _baseline(reason: str) -> RouteResult:
    return RouteResult(Route.BASELINE, reason)


class Gate:
    """The gate's decision logic and its feedback loop; one instance per model instance.

    Per request, the adapter takes a ticket from `admission` first (AdmissionQueue: it may refuse
    the request as overloaded), then calls `decide()` once and `finish()` exactly once afterwards
    (it counts requests in flight for the load gate). In between: `record_speculative()` when a
    speculative engine (served or mirrored) finished with stats, `record_failure()` when an engine call failed,
    and, for `decision.shadow`, `end_shadow()` exactly once (frees the mirror slot).
    """

    def __init__(
        self,
        policy_path: str | os.PathLike[str] | None = None,
        *,
        metric_factory: Any | None = None,
        now: Callable[[], float] = time.monotonic,
        reload_interval_s: float = 1.0,
        label_secret: bytes | None = None,
        calibration_path: str | os.PathLike[str] | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        """`label_secret` keys the tenant labels (labels.py); None: a random one for this process.
        `calibration_path`: spec_engine's published calibration, reloaded as it changes; or a fixed
        `calibration` (tests, benchmarks); neither: route on the policy alone."""
        self._store = PolicyStore(policy_path, check_interval_s=reload_interval_s, now=now)
        self._calibration = (
            CalibrationStore(Path(calibration_path), now, reload_interval_s) if calibration_path else CalibrationStore.fixed(calibration)
        )
        self._tenant_labels = TenantLabels(label_secret if label_secret is not None else secrets.token_bytes(32))
        self._metrics = GateMetrics(metric_factory, ROUTE_OF.items())
        # the adapter's bounded queue (admission.py); limits from the live policy
        self.admission = AdmissionQueue(lambda: self._store.current().admission, self._metrics)
        self._breakers = CircuitBreakers(now, on_transition=self._on_transition)
        self._fleet = FleetGains()  # every tenant's gain per prompt class: evidence for a class a tenant has none of
        self._lock = threading.Lock()
        self._in_flight = 0
        self._mirrors = 0
        self._labels: dict[str, str] = {}  # tenant name (or ORG) -> label
        self._declared: Loaded | None = None
        self._declare(self._store.snapshot())

    @property
    def policy(self) -> Policy:
        return self._store.current()

    @property
    def breakers(self) -> CircuitBreakers:
        return self._breakers

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def decide(self, inputs: GateRequest) -> Decision:
        """Route one request. Raises PolicyError for a request the policy rejects (INVALID_ARG)."""
        start = time.perf_counter()
        loaded = self._store.snapshot()
        if loaded is not self._declared:
            self._declare(loaded)
        policy, keys = loaded
        tenant_key, tenant = tenant_of(inputs.api_key, policy, keys)
        label = self._label(tenant_key)
        requested = requested_mode(inputs, policy)
        cal = self._calibration.current()
        # the last check that may reject it
        algorithm, k = speculation(inputs, tenant, policy, cal, lambda: self._acceptance(tenant_key, policy))
        if requested is not None and not setting(tenant, "allow_override", policy.allow_override):
            self._metrics.override_ignored(label)
            requested = None
        mode = requested if requested is not None else setting(tenant, "mode", policy.mode)
        with self._lock:  # count this request and read the load before it, atomically
            already = self._in_flight
            self._in_flight += 1
        prompt_class = policy.breaker.prompt_class(inputs.prompt_tokens)
        found = self._route(inputs, policy, tenant, tenant_key, prompt_class, mode, requested is not None, already, cal, algorithm)
        decision = Decision(found.route, found.reason, found.shadow, algorithm, k, mode, label, found.probe, tenant_key, prompt_class)
        self._metrics.decision(found.route, found.reason, time.perf_counter() - start)
        self._metrics.in_flight(already + 1)
        return decision

    def finish(self, decision: Decision) -> None:
        with self._lock:
            self._in_flight -= 1
            in_flight = self._in_flight
        self._metrics.in_flight(in_flight)

    def record_speculative(self, decision: Decision, stats: GateStats) -> None:
        """Stats of a finished speculative request or shadow mirror: metrics and the tenant's EMA."""
        drafts = stats.num_drafts
        if not drafts and stats.draft_tokens > 0 and decision.num_speculative_tokens:
            drafts = -(-stats.draft_tokens // decision.num_speculative_tokens)
        self._metrics.speculative_stats(
            drafts or 0, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position
        )
        breaker = self._breaker_policy(self._store.current(), decision.algorithm)
        ema = self._breakers.record_acceptance(
            decision.tenant_key, stats.accepted_tokens, stats.draft_tokens, breaker, stats.modelled_speedup, decision.prompt_class,
        )
        if stats.modelled_speedup is not None:
            self._fleet.record(decision.algorithm, decision.prompt_class, stats.modelled_speedup, breaker.ema_weight)
        if ema is not None:
            self._metrics.acceptance_rate(decision.tenant, ema)

    def record_failure(self, decision: Decision, engine: Route) -> None:
        """An engine call failed. Speculative-engine failures count towards the tenant's breaker."""
        self._metrics.engine_failure(engine)
        if engine is Route.SPECULATIVE:
            self._breakers.record_failure(decision.tenant_key, self._breaker_policy(self._store.current(), decision.algorithm))

    def record_cancelled(self) -> None:
        """The client cancelled a request mid-stream (not the engine's failure: no breaker sample)."""
        self._metrics.cancelled()

    def end_shadow(self, decision: Decision, mismatch: bool | None) -> None:
        """A shadow mirror ended: `mismatch` from comparing outputs, None if it did not complete."""
        with self._lock:
            self._mirrors -= 1
            mirrors = self._mirrors
        self._metrics.mirrors(mirrors)
        if mismatch is not None:
            self._metrics.shadow_compared(mismatch)

    def _route(
        self,
        inputs: GateRequest,
        policy: Policy,
        tenant: TenantPolicy | None,
        tenant_key: str,
        prompt_class: int,
        mode: Mode,
        from_request: bool,
        in_flight: int,
        cal: Calibration | None,
        algorithm: str,
    ) -> RouteResult:
        if mode is Mode.OFF:
            return _baseline(MODE_OFF)
        threshold = setting(tenant, "temperature_threshold", policy.temperature_threshold)
        if inputs.temperature is not None and inputs.temperature > threshold:
            return _baseline(TEMPERATURE)
        if cal is None and self._calibration.follows_engine:  # it would wait behind the measuring
            return _baseline(CALIBRATING)
        canary = 100.0 if from_request else setting(tenant, "canary_percent", policy.canary_percent)
        if mode is Mode.PROD and canary < 100.0 and not in_canary(inputs.request_id or inputs.canary_key, canary):
            return _baseline(CANARY_OUT)
        limit = policy.load.max_in_flight
        if limit is not None and in_flight >= limit:
            return _baseline(LOAD)
        judged = mode is Mode.PROD and not from_request and cal is not None
        if judged and not can_pay(cal, algorithm):
            return _baseline(NO_GAIN)
        breaker = self._breaker_policy(policy, algorithm)
        paying = not judged or self._pays(tenant_key, prompt_class, cal, algorithm, breaker)
        admission = self._breakers.admit(tenant_key, breaker, lambda: not paying)
        if admission is Admission.UNPROVEN:
            return _baseline(NO_GAIN)
        if admission is Admission.DENY:
            return _baseline(CIRCUIT_OPEN)
        if admission is Admission.ALLOW and not paying:  # its evidence says the route buys too little here
            if self._breakers.explore(tenant_key, breaker, prompt_class):
                return RouteResult(Route.SPECULATIVE, GAIN_PROBE, probe=True)
            return _baseline(NO_GAIN)
        probe = admission is Admission.PROBE
        if mode is Mode.SHADOW:
            with self._lock:
                free = self._mirrors < policy.shadow.max_concurrent_mirrors
                if free:
                    self._mirrors += 1
                mirrors = self._mirrors
            self._metrics.mirrors(mirrors)
            return RouteResult(Route.BASELINE, SHADOW, shadow=True, probe=probe) if free else _baseline(SHADOW_BUSY)
        if probe:
            return RouteResult(Route.SPECULATIVE, HALF_OPEN_PROBE, probe=True)
        return RouteResult(Route.SPECULATIVE, PROD if canary >= 100.0 else CANARY_IN)

    def _breaker_policy(self, policy: Policy, algorithm: str) -> BreakerPolicy:
        """The breaker settings with `auto` thresholds made concrete for this algorithm."""
        cal = self._calibration.current()
        if cal is not None and algorithm in cal.algorithms:
            return policy.breaker.pinned(*breaker_thresholds(cal, algorithm))
        return policy.breaker.pinned(FALLBACK_OPEN, FALLBACK_CLOSE)

    def _pays(self, tenant_key: str, prompt_class: int, cal: Calibration, algorithm: str, breaker: BreakerPolicy) -> bool:
        """Whether the route is expected to buy `min_gain` for this request: by what the tenant's
        requests of its prompt class bought (the EMA of spec_engine's modelled speedup); else yes
        where all tenants' requests of that class bought it (fleet.py: evidence that only admits);
        else by what all the tenant's requests bought, else by the curve at its acceptance EMA once
        that rests on enough samples, else at the algorithm's prior."""
        min_gain = breaker.min_gain
        snap = self._breakers.snapshot(tenant_key, prompt_class)
        if snap.class_gain is not None:
            return snap.class_gain >= min_gain
        if self._fleet.pays(algorithm, prompt_class, min_gain, breaker.probe_samples):
            return True
        if snap.gain is not None:
            return snap.gain >= min_gain
        return pays(cal, algorithm, snap.ema if snap.samples >= breaker.min_samples else None, min_gain)

    def _acceptance(self, tenant_key: str, policy: Policy) -> float | None:
        """The tenant's acceptance EMA, once it rests on enough samples (`auto` picks by it)."""
        snap = self._breakers.snapshot(tenant_key)
        return snap.ema if snap.samples >= policy.breaker.min_samples else None

    def _label(self, tenant_key: str) -> str:
        label = self._labels.get(tenant_key)
        if label is None:
            label = self._labels[tenant_key] = ORG if tenant_key == ORG else self._tenant_labels(tenant_key)
        return label

    def _declare(self, loaded: Loaded) -> None:
        """Export the series of a (re)loaded policy's tenants and draft positions at 0, so dashboards
        and rate() alerts have them before their first event. Runs again after a reload; series that
        exist already are kept as they are."""
        self._declared = loaded
        for tenant in (ORG, *sorted(loaded.keys.names)):
            if tenant not in self._labels:
                log.info("tenant %s: metric label %s", tenant, self._label(tenant))
            self._metrics.declare_tenant(self._labels[tenant])
        self._metrics.declare_positions(loaded.policy.speculative.max_num_speculative_tokens or MAX_POSITIONS)

    def _on_transition(self, tenant_key: str, old: BreakerState, new: BreakerState) -> None:
        label = self._label(tenant_key)
        log.info("breaker %s: %s -> %s", label, old.value, new.value)
        self._metrics.circuit_state(label, _CIRCUIT_GAUGE[new])
