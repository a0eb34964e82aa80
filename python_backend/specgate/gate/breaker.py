"""Per-tenant circuit breaker on the rolling speculative acceptance rate and modelled speedup.

Two EMAs per tenant, one sample per finished speculative request:

    alpha_t = (1 - w) * alpha_{t-1} + w * (accepted / drafted)        w = breaker.ema_weight
    gain_t  = (1 - w) * gain_{t-1}  + w * modelled_speedup

alpha from requests that drafted at least one token; gain from every request whose engine reports
its modelled speedup (the CPU engines: what the request's steps bought over plain decoding on the
engine's cost curve; 1.0 for a request that never drafted). Acceptance alone cannot tell a route
that pays from one that does not where drafts are rare: a machine whose verification is steep
drafts only its surest guesses, which are accepted, and decodes plainly the rest of the time, so
the route costs its own overhead and buys nothing. Weighted per request, not per draft token, so one
long generation cannot outvote many short ones (what a tenant experiences is per request). Each
EMA is the plain mean of its samples until they number 1/w (goodput.WarmMean), so that a verdict on
a few probes weighs them alike.

States (each tenant has its own; tenants never affect one another):

    closed    -> open       after >= min_samples samples with alpha < open_threshold, or as many
                            with every prompt class's gain < min_gain, or failure_threshold
                            consecutive engine failures
    open      -> half_open  cooldown_s after opening (checked when the tenant's next request arrives)
    half_open -> closed     after probe_samples probe results with alpha >= close_threshold and
                            some prompt class's gain >= min_gain (each where measured)
    half_open -> open       after probe_samples probe results otherwise, or on any engine failure

A tenant can also start half-open: where spec_engine's cost curve expects drafting not to pay at the
algorithm's prior acceptance (the gate's `admit(..., unproven)` says so for its first request), the
route is not taken on faith until the tenant's own probes show it pays. Its requests that are not
probes are refused as UNPROVEN (reason `no_gain`) until the first probe verdict, except those not
judged by the prior (a request that asked for the route itself), whose results count as probes; after
the verdict it is an ordinary breaker.

The gain EMA is also kept per prompt class of the tenant (BreakerPolicy.prompt_class: prompt lengths),
fed by the same samples: the gate routes a request on its class's gain once that class has one
(router.Gate._pays), since one tenant's summaries of long documents may pay where its short chat turns
do not. So the gain rules of the states below read the best class's EMA: the circuit opens on gain only
where no class of the tenant pays.

Entering half_open restarts both EMAs, so recovery is judged on the probes alone, not on the samples
that opened the circuit. In half_open a bounded fraction (probe_fraction) of the tenant's requests
is admitted as probes: the 1st, then one more each time admitted/seen falls to the fraction.

Time comes from an injected `now()` so tests drive cooldowns without sleeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from specgate.cost_model.goodput import WarmMean
from specgate.gate.policy import BreakerPolicy


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(str, Enum):
    ALLOW = "allow"  # closed: speculate
    PROBE = "probe"  # half-open: speculate as a probe
    DENY = "deny"  # open, or half-open and not chosen as a probe
    UNPROVEN = "unproven"  # started half-open on the cost curve's say-so, no probe verdict yet; not a probe


Transition = Callable[[str, BreakerState, BreakerState], None]


@dataclass(slots=True)
class _ClassGain:
    """One prompt class of a tenant: its gain EMA, and how many of its requests judged short of
    min_gain went speculative anyway to keep measuring it."""

    gain: WarmMean = field(default_factory=WarmMean)
    judged_short: int = 0
    explored: int = 0


@dataclass(slots=True)
class _Tenant:
    state: BreakerState = BreakerState.CLOSED
    acceptance: WarmMean = field(default_factory=WarmMean)
    gain: WarmMean = field(default_factory=WarmMean)
    consecutive_failures: int = 0
    opened_at: float = 0.0
    seen: int = 0  # requests seen in the current half-open period
    probes: int = 0  # of which admitted as probes
    classes: dict[int, _ClassGain] = field(default_factory=dict)  # prompt class -> its gain and exploration
    probe_results: int = 0
    unproven: bool = False  # half-open since first seen, no probe verdict yet

    def best_gain(self) -> float | None:
        """The gain EMA of the tenant's best prompt class: the route pays for the tenant while it pays
        for one of its classes (the gate keeps the others on the baseline, request by request)."""
        return max((c.gain.value for c in self.classes.values() if c.gain.value is not None), default=None)


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    state: BreakerState
    ema: float | None
    samples: int
    gain: float | None = None
    class_gain: float | None = None  # the gain EMA of the asked prompt class, None before its first sample


class CircuitBreakers:
    """All tenants' breakers. Thread-safe; `on_transition(tenant, old, new)` runs under the lock."""

    def __init__(self, now: Callable[[], float], on_transition: Transition | None = None) -> None:
        self._now = now
        self._on_transition = on_transition
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: str, cfg: BreakerPolicy, unproven: Callable[[], bool] = lambda: False) -> Admission:
        """`unproven()`: this request is judged by the prior, which expects the route not to pay. A
        tenant seen for the first time then starts half-open (its probes measure it) instead of
        closed. A request not judged by the prior (it asked for the route itself) is not held back by
        it. Asked only for a tenant without a breaker yet or still unproven: it costs a curve
        evaluation, which most requests need not pay for."""
        with self._lock:
            t = self._tenants.get(tenant)
            if t is None:
                if not unproven():
                    return Admission.ALLOW
                t = self._tenants[tenant] = _Tenant()
                self._move(tenant, t, BreakerState.HALF_OPEN)
                t.unproven = True
            elif t.state is BreakerState.CLOSED or (t.unproven and not unproven()):
                return Admission.ALLOW
            if t.state is BreakerState.OPEN:
                if self._now() - t.opened_at < cfg.cooldown_s:
                    return Admission.DENY
                self._move(tenant, t, BreakerState.HALF_OPEN)
            t.seen += 1
            # Probe while the admitted share is at or below the fraction; the first request probes.
            if t.probes <= cfg.probe_fraction * (t.seen - 1) + 1e-9:
                t.probes += 1
                return Admission.PROBE
            return Admission.UNPROVEN if t.unproven else Admission.DENY

    def explore(self, tenant: str, cfg: BreakerPolicy, prompt_class: int = 0) -> bool:
        """A closed tenant's request expected to buy less than min_gain: whether it goes speculative
        anyway, to keep its prompt class measured (one in `probe_fraction` per class, the first at once)."""
        with self._lock:
            c = self._tenants.setdefault(tenant, _Tenant()).classes.setdefault(prompt_class, _ClassGain())
            c.judged_short += 1
            if c.explored <= cfg.probe_fraction * (c.judged_short - 1) + 1e-9:
                c.explored += 1
                return True
            return False

    def record_acceptance(
        self, tenant: str, accepted: int, drafted: int, cfg: BreakerPolicy, gain: float | None = None, prompt_class: int = 0
    ) -> float | None:
        """Feed one finished speculative request (`gain`: its modelled speedup, where the engine
        reports one; `prompt_class`: its prompt's class); returns the tenant's acceptance EMA."""
        with self._lock:
            t = self._tenants.setdefault(tenant, _Tenant())
            if drafted <= 0 and gain is None:
                return t.acceptance.value  # nothing was drafted and nothing modelled: no evidence either way
            w = cfg.ema_weight
            if drafted > 0:
                rate = min(max(accepted / drafted, 0.0), 1.0)
                t.acceptance.add(rate, w)
            if gain is not None:
                t.gain.add(gain, w)
                t.classes.setdefault(prompt_class, _ClassGain()).gain.add(gain, w)
            t.consecutive_failures = 0
            if t.state is BreakerState.CLOSED:
                acc = t.acceptance
                low_acceptance = acc.value is not None and acc.samples >= cfg.min_samples and acc.value < cfg.open_threshold
                best = t.best_gain()
                no_gain = best is not None and t.gain.samples >= cfg.min_samples and best < cfg.min_gain
                if low_acceptance or no_gain:
                    self._move(tenant, t, BreakerState.OPEN)
            elif t.state is BreakerState.HALF_OPEN:
                t.probe_results += 1
                if t.probe_results >= cfg.probe_samples:
                    best = t.best_gain()
                    acc = t.acceptance.value
                    ok = (acc is None or acc >= cfg.close_threshold) and (best is None or best >= cfg.min_gain)
                    self._move(tenant, t, BreakerState.CLOSED if ok else BreakerState.OPEN)
            # OPEN: results of requests admitted before it opened update the EMA only.
            return t.acceptance.value

    def record_failure(self, tenant: str, cfg: BreakerPolicy) -> None:
        """A speculative-engine failure for this tenant; repeated failures open the circuit."""
        with self._lock:
            t = self._tenants.setdefault(tenant, _Tenant())
            t.consecutive_failures += 1
            if t.state is BreakerState.HALF_OPEN or (
                t.state is BreakerState.CLOSED and t.consecutive_failures >= cfg.failure_threshold
            ):
                self._move(tenant, t, BreakerState.OPEN)

    def snapshot(self, tenant: str, prompt_class: int = 0) -> BreakerSnapshot:
        with self._lock:
            t = self._tenants.get(tenant) or _Tenant()
            c = t.classes.get(prompt_class)
            return BreakerSnapshot(t.state, t.acceptance.value, t.acceptance.samples, t.gain.value, None if c is None else c.gain.value)

    def _move(self, tenant: str, t: _Tenant, new: BreakerState) -> None:
        old, t.state, t.unproven = t.state, new, False
        if new is BreakerState.OPEN:
            t.opened_at = self._now()
        elif new is BreakerState.HALF_OPEN:
            t.acceptance, t.gain, t.seen, t.probes, t.probe_results = WarmMean(), WarmMean(), 0, 0, 0
            t.classes = {}
        t.consecutive_failures = 0
        if self._on_transition is not None:
            self._on_transition(tenant, old, new)
