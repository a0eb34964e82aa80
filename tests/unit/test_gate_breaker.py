"""Circuit breaker: EMA maths and closed -> open -> half_open -> closed/open with injected time."""

from __future__ import annotations

import pytest

from specgate.gate.breaker import Admission, BreakerState, CircuitBreakers
from specgate.gate.policy import BreakerPolicy

CFG = BreakerPolicy(
    ema_weight=0.5, open_threshold=0.55, close_threshold=0.6, min_samples=3, cooldown_s=10.0,
    probe_fraction=0.25, probe_samples=2, failure_threshold=3,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def transitions() -> list[tuple[str, str, str]]:
    return []


@pytest.fixture
def br(clock: Clock, transitions: list[tuple[str, str, str]]) -> CircuitBreakers:
    return CircuitBreakers(clock, on_transition=lambda t, a, b: transitions.append((t, a.value, b.value)))


def _open(br: CircuitBreakers, tenant: str = "a") -> None:
    for _ in range(CFG.min_samples):
        br.record_acceptance(tenant, 0, 10, CFG)
    assert br.snapshot(tenant).state is BreakerState.OPEN


def test_ema_maths(br: CircuitBreakers) -> None:
    assert br.record_acceptance("a", 8, 10, CFG) == pytest.approx(0.8)  # first sample seeds
    assert br.record_acceptance("a", 2, 10, CFG) == pytest.approx(0.5 * 0.8 + 0.5 * 0.2)
    assert br.record_acceptance("a", 1, 1, CFG) == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)
    # per-request weighting: a 1-token draft moves the EMA as much as a 10-token one
    assert br.record_acceptance("a", 0, 0, CFG) == pytest.approx(0.75)  # nothing drafted: no sample
    assert br.snapshot("a").samples == 3


def test_does_not_open_before_min_samples(br: CircuitBreakers) -> None:
    br.record_acceptance("a", 0, 10, CFG)
    br.record_acceptance("a", 0, 10, CFG)
    assert br.snapshot("a").state is BreakerState.CLOSED
    assert br.admit("a", CFG) is Admission.ALLOW
    br.record_acceptance("a", 0, 10, CFG)
    assert br.snapshot("a").state is BreakerState.OPEN


def test_stays_closed_at_threshold(br: CircuitBreakers) -> None:
    for _ in range(10):
        br.record_acceptance("a", 55, 100, CFG)  # EMA == 0.55 is not below 0.55
    assert br.snapshot("a").state is BreakerState.CLOSED


def test_open_half_open_close(br: CircuitBreakers, clock: Clock, transitions: list) -> None:
    _open(br)
    assert br.admit("a", CFG) is Admission.DENY
    clock.t = 9.99
    assert br.admit("a", CFG) is Admission.DENY  # still cooling down
    clock.t = 10.0
    # half-open: probe_fraction 0.25 -> 1 probe in every 4 requests, the first one probes
    admitted = [br.admit("a", CFG) for _ in range(8)]
    assert admitted == [Admission.PROBE] + [Admission.DENY] * 3 + [Admission.PROBE] + [Admission.DENY] * 3
    assert br.snapshot("a").state is BreakerState.HALF_OPEN and br.snapshot("a").ema is None
    br.record_acceptance("a", 9, 10, CFG)
    assert br.snapshot("a").state is BreakerState.HALF_OPEN  # needs probe_samples=2 results
    br.record_acceptance("a", 7, 10, CFG)  # EMA 0.8 >= 0.6
    assert br.snapshot("a").state is BreakerState.CLOSED
    assert br.admit("a", CFG) is Admission.ALLOW
    assert transitions == [("a", "closed", "open"), ("a", "open", "half_open"), ("a", "half_open", "closed")]


def test_half_open_reopens_when_probes_stay_low(br: CircuitBreakers, clock: Clock) -> None:
    _open(br)
    clock.t = 10.0
    assert br.admit("a", CFG) is Admission.PROBE
    br.record_acceptance("a", 6, 10, CFG)
    br.record_acceptance("a", 5, 10, CFG)  # EMA 0.55 < close 0.6
    assert br.snapshot("a").state is BreakerState.OPEN
    clock.t = 19.0
    assert br.admit("a", CFG) is Admission.DENY  # a fresh cooldown from t=10
    clock.t = 20.0
    assert br.admit("a", CFG) is Admission.PROBE


def test_failures_open_and_reset(br: CircuitBreakers, clock: Clock) -> None:
    br.record_failure("a", CFG)
    br.record_failure("a", CFG)
    br.record_acceptance("a", 9, 10, CFG)  # a success resets the consecutive count
    br.record_failure("a", CFG)
    br.record_failure("a", CFG)
    assert br.snapshot("a").state is BreakerState.CLOSED
    br.record_failure("a", CFG)
    assert br.snapshot("a").state is BreakerState.OPEN
    clock.t = 10.0
    assert br.admit("a", CFG) is Admission.PROBE
    br.record_failure("a", CFG)  # one failed probe re-opens
    assert br.snapshot("a").state is BreakerState.OPEN


def test_tenants_are_isolated(br: CircuitBreakers) -> None:
    _open(br, "a")
    for _ in range(5):
        br.record_acceptance("b", 9, 10, CFG)
    assert br.admit("a", CFG) is Admission.DENY
    assert br.admit("b", CFG) is Admission.ALLOW
    assert br.admit("never-seen", CFG) is Admission.ALLOW
    assert br.snapshot("b").ema == pytest.approx(0.9)


def test_a_route_that_buys_nothing_opens_even_with_high_acceptance(br: CircuitBreakers, clock: Clock) -> None:
    """Drafts accepted 90% of the time, but so rare or so dear that the modelled speedup is 1.01."""
    for _ in range(CFG.min_samples - 1):
        br.record_acceptance("a", 9, 10, CFG, gain=1.01)
        assert br.snapshot("a").state is BreakerState.CLOSED  # not before min_samples
    br.record_acceptance("a", 9, 10, CFG, gain=1.01)
    snap = br.snapshot("a")
    assert snap.state is BreakerState.OPEN and snap.ema == pytest.approx(0.9) and snap.gain == pytest.approx(1.01)
    # requests that never drafted are evidence too (gain 1.0), and so is a paying one
    br2 = CircuitBreakers(clock)
    for _ in range(CFG.min_samples):
        br2.record_acceptance("b", 0, 0, CFG, gain=1.0)
    assert br2.snapshot("b").state is BreakerState.OPEN and br2.snapshot("b").ema is None
    for _ in range(10):
        br2.record_acceptance("c", 7, 10, CFG, gain=1.4)
    assert br2.snapshot("c").state is BreakerState.CLOSED


def test_probes_close_only_if_the_route_pays_again(br: CircuitBreakers, clock: Clock) -> None:
    for _ in range(CFG.min_samples):
        br.record_acceptance("a", 9, 10, CFG, gain=1.0)
    clock.t += CFG.cooldown_s
    assert br.admit("a", CFG) is Admission.PROBE  # half-open: the EMAs restart
    for _ in range(CFG.probe_samples):
        br.record_acceptance("a", 9, 10, CFG, gain=1.0)  # accepted, but still buying nothing
    assert br.snapshot("a").state is BreakerState.OPEN
    clock.t += CFG.cooldown_s
    assert br.admit("a", CFG) is Admission.PROBE
    for _ in range(CFG.probe_samples):
        br.record_acceptance("a", 9, 10, CFG, gain=1.5)
    assert br.snapshot("a").state is BreakerState.CLOSED


def test_min_gain_one_keeps_the_acceptance_rule_alone(br: CircuitBreakers) -> None:
    cfg = CFG.model_copy(update={"min_gain": 1.0})
    for _ in range(CFG.min_samples + 2):
        br.record_acceptance("a", 9, 10, cfg, gain=1.0)
    assert br.snapshot("a").state is BreakerState.CLOSED


def test_an_unproven_tenant_starts_half_open_and_its_probes_decide(br: CircuitBreakers, transitions: list) -> None:
    # probe_fraction 0.25: the 1st request probes, then one more each time admitted/seen falls to 1/4
    got = [br.admit("a", CFG, unproven=lambda: True) for _ in range(5)]
    assert got == [Admission.PROBE, Admission.UNPROVEN, Admission.UNPROVEN, Admission.UNPROVEN, Admission.PROBE]
    assert transitions == [("a", "closed", "half_open")]
    for _ in range(CFG.probe_samples):  # probes that show the route pays: an ordinary closed breaker
        br.record_acceptance("a", 9, 10, CFG, gain=1.5)
    assert br.snapshot("a").state is BreakerState.CLOSED
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.ALLOW  # evidence now, not the prior


def test_an_unproven_tenant_whose_probes_do_not_pay_opens_and_is_then_an_ordinary_breaker(br: CircuitBreakers, clock: Clock) -> None:
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.PROBE
    for _ in range(CFG.probe_samples):
        br.record_acceptance("a", 9, 10, CFG, gain=1.0)  # accepted, but buys nothing (min_gain 1.03)
    assert br.snapshot("a").state is BreakerState.OPEN
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.DENY  # measured: circuit_open, not the prior's no_gain
    clock.t += CFG.cooldown_s
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.PROBE
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.DENY


def test_a_verdict_weighs_its_probes_alike(br: CircuitBreakers) -> None:
    """The shipped weight (0.1) and five probes: an odd first probe, a warm-up asking for 8 tokens
    that drafted nothing (gain 1.0), must not outweigh four that paid 1.08 (a mean of 1.064 against
    min_gain 1.03). An EMA seeded with the first sample read 1.027 and opened the circuit, as on the
    Zen 3 EPYC (docs/gate.md, "Circuit breaker")."""
    cfg = BreakerPolicy(open_threshold=0.3, close_threshold=0.4)
    assert cfg.ema_weight == 0.1 and cfg.probe_samples == 5
    assert br.admit("a", cfg, unproven=lambda: True) is Admission.PROBE
    br.record_acceptance("a", 0, 0, cfg, gain=1.0, prompt_class=1)
    for _ in range(cfg.probe_samples - 1):
        br.record_acceptance("a", 7, 10, cfg, gain=1.08, prompt_class=1)
    snap = br.snapshot("a", 1)
    assert snap.class_gain == pytest.approx((1.0 + 4 * 1.08) / 5)
    assert snap.state is BreakerState.CLOSED


def test_the_warm_up_mean_becomes_the_ema_after_one_over_weight_samples(br: CircuitBreakers) -> None:
    cfg = BreakerPolicy(open_threshold=0.0, close_threshold=0.0, ema_weight=0.25, min_samples=100)
    for rate in (2, 4, 6, 8):  # four samples: their plain mean
        br.record_acceptance("a", rate, 10, cfg)
    assert br.snapshot("a").ema == pytest.approx(0.5)
    assert br.record_acceptance("a", 10, 10, cfg) == pytest.approx(0.75 * 0.5 + 0.25 * 1.0)  # then weight 0.25


def test_a_tenant_with_evidence_is_not_judged_by_the_prior(br: CircuitBreakers) -> None:
    br.record_acceptance("a", 9, 10, CFG, gain=1.5)  # e.g. a request that asked for prod itself
    assert br.admit("a", CFG, unproven=lambda: True) is Admission.ALLOW
    assert br.admit("b", CFG) is Admission.ALLOW  # the route is expected to pay: closed from the start


def test_the_circuit_opens_on_gain_only_where_no_prompt_class_pays(br: CircuitBreakers, clock: Clock) -> None:
    """Long prompts pay and short ones do not: the gate keeps the short ones on the baseline request by
    request, so the tenant's circuit stays closed while one class pays; it opens when none does, and
    its probes close it again when one class pays."""
    long_, short = 1, 0
    for _ in range(4):  # the tenant-wide EMA ends below min_gain, the long class's stays above
        br.record_acceptance("a", 9, 10, CFG, gain=1.4, prompt_class=long_)
        br.record_acceptance("a", 9, 10, CFG, gain=0.8, prompt_class=short)
    snap, best = br.snapshot("a", short), br.snapshot("a", long_).class_gain
    assert snap.gain is not None and snap.gain < CFG.min_gain and snap.class_gain == pytest.approx(0.8)
    assert snap.state is BreakerState.CLOSED and best == pytest.approx(1.4)
    for _ in range(3):  # the long prompts stop paying too
        br.record_acceptance("a", 9, 10, CFG, gain=0.9, prompt_class=long_)
    assert br.snapshot("a").state is BreakerState.OPEN
    clock.t += CFG.cooldown_s
    assert br.admit("a", CFG) is Admission.PROBE
    br.record_acceptance("a", 9, 10, CFG, gain=0.8, prompt_class=short)
    br.record_acceptance("a", 9, 10, CFG, gain=1.3, prompt_class=long_)  # one class pays again
    assert br.snapshot("a").state is BreakerState.CLOSED
