"""Gate.decide(): precedence, rules and their order, reason codes, accounting."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from specgate.cost_model.calibration import Calibration
from specgate.cost_model.goodput import CostCurve
from specgate.gate import REASONS, Decision, Gate, RequestInputs, Route
from specgate.gate.breaker import BreakerState
from specgate.gate.labels import TenantLabels
from specgate.gate.metrics import InMemoryMetricFactory
from specgate.gate.policy import Mode, PolicyError
from specgate.gate.tenants import hash_key
from specgate.stats import SpecStats

KEY_A, KEY_B = "key-a", "key-b"
KEYS = f"team-a: [{hash_key(KEY_A)}]\nteam-b: [{hash_key(KEY_B)}]\n"
SECRET = b"test-label-secret"

POLICY = """
mode: prod
allow_override: true
key_file: keys.yaml
breaker: {min_samples: 2, ema_weight: 0.5, cooldown_s: 5, probe_fraction: 0.5, probe_samples: 1}
load: {max_in_flight: 3}
shadow: {max_concurrent_mirrors: 1}
tenants:
  team-a: {mode: off, algorithm: ngram, num_speculative_tokens: 6}
  team-b: {mode: shadow, temperature_threshold: 1.2}
"""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_gate(
    tmp_path: Path, text: str = POLICY, clock: Clock | None = None, secret: bytes = SECRET, calibration: Calibration | None = None
) -> Gate:
    (tmp_path / "keys.yaml").write_text(KEYS)
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return Gate(str(path), now=clock or Clock(), label_secret=secret, calibration=calibration)


def decide(gate: Gate, **kw: object) -> tuple[str, str, bool]:
    d = gate.decide(RequestInputs(**kw))  # type: ignore[arg-type]
    if d.shadow:
        gate.end_shadow(d, mismatch=None)
    gate.finish(d)
    return d.route, d.reason, d.shadow


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    return make_gate(tmp_path)


def test_precedence_header_over_bool_over_tenant_over_org(gate: Gate) -> None:
    assert decide(gate) == ("speculative", "prod", False)  # org: prod
    assert decide(gate, api_key=KEY_A) == ("baseline", "mode_off", False)  # tenant: off
    assert decide(gate, api_key=KEY_A, use_speculative_decoding=True)[1] == "prod"
    assert decide(gate, api_key=KEY_A, spec_header="prod", use_speculative_decoding=False)[1] == "prod"
    assert decide(gate, spec_header="off", use_speculative_decoding=True)[1] == "mode_off"
    assert decide(gate, spec_header=" SHADOW ")[1] == "shadow"
    assert decide(gate, api_key=KEY_B)[1] == "shadow"


def test_malformed_header_is_an_error_naming_header_and_values(gate: Gate) -> None:
    with pytest.raises(PolicyError, match=r"x-speculative-decoding.*'maybe'.*off, shadow, prod"):
        gate.decide(RequestInputs(spec_header="maybe"))
    assert gate.in_flight == 0  # a rejected request is not counted


def test_malformed_header_ignored_when_policy_says_so(tmp_path: Path) -> None:
    g = make_gate(tmp_path, "mode: off\nmalformed_header: ignore\nallow_override: true\n")
    assert decide(g, spec_header="maybe")[1] == "mode_off"
    assert decide(g, spec_header="maybe", use_speculative_decoding=True)[1] == "prod"


def test_unknown_tenant_gets_org_default_or_is_rejected(gate: Gate, tmp_path: Path) -> None:
    d = gate.decide(RequestInputs(api_key="who-is-this"))
    assert (d.route, d.tenant, d.mode) == ("speculative", "org", Mode.PROD)
    strict = make_gate(tmp_path, "mode: prod\nunknown_tenant: reject\nkey_file: keys.yaml\n")
    for key in ("who-is-this", None, ""):
        with pytest.raises(PolicyError, match="x-api-key") as err:
            strict.decide(RequestInputs(api_key=key))
        assert "who-is-this" not in str(err.value)
    d = strict.decide(RequestInputs(api_key=KEY_A))  # in the key file, no settings: org's, own breaker
    assert (d.route, d.tenant_key) == ("speculative", "team-a")


def test_request_override_is_honoured_only_where_allowed(tmp_path: Path) -> None:
    pb = InMemoryMetricFactory()
    path = tmp_path / "policy.yaml"
    (tmp_path / "keys.yaml").write_text(KEYS)
    path.write_text("mode: off\nkey_file: keys.yaml\ntenants: {team-a: {allow_override: true}}\n")
    g = Gate(str(path), metric_factory=pb, label_secret=SECRET)
    ignored = pb.families["spec_gate_override_ignored_total"]
    assert decide(g, spec_header="prod") == ("baseline", "mode_off", False)  # org: not allowed (default)
    assert decide(g, use_speculative_decoding=True)[1] == "mode_off"  # the BOOL input is an override too
    assert decide(g, api_key=KEY_B, spec_header="shadow")[1] == "mode_off"  # team-b inherits the org's no
    assert decide(g, api_key=KEY_A, spec_header="prod")[1] == "prod"
    assert ignored.value(tenant="org") == 2 and ignored.value(tenant=TenantLabels(SECRET)("team-b")) == 1
    assert ignored.value(tenant=TenantLabels(SECRET)("team-a")) == 0
    with pytest.raises(PolicyError, match="x-speculative-decoding"):
        g.decide(RequestInputs(spec_header="maybe"))  # malformed is still an error, allowed or not


def test_tenant_label_is_keyed_by_the_server_secret(tmp_path: Path) -> None:
    def label(secret: bytes) -> str:
        return make_gate(tmp_path, secret=secret).decide(RequestInputs(api_key=KEY_B)).tenant

    assert label(b"s1") == label(b"s1") == TenantLabels(b"s1")("team-b")  # stable across restarts
    assert label(b"s2") != label(b"s1")
    assert label(b"s1") != hashlib.sha256(KEY_B.encode()).hexdigest()[:8]  # the old, reversible label
    assert KEY_B not in repr(make_gate(tmp_path).decide(RequestInputs(api_key=KEY_B)))


def test_algorithm_and_k_resolution(gate: Gate) -> None:
    d = gate.decide(RequestInputs(use_speculative_decoding=True, api_key=KEY_A))
    assert (d.algorithm, d.num_speculative_tokens) == ("ngram", 6)  # tenant overrides
    d = gate.decide(RequestInputs(api_key=KEY_A, speculative_algorithm="eagle2", num_speculative_tokens=2))
    assert (d.algorithm, d.num_speculative_tokens) == ("eagle2", 2)  # request wins
    d = gate.decide(RequestInputs())
    assert (d.algorithm, d.num_speculative_tokens) == ("eagle", None)  # auto without a calibration; k is the engine's
    d = gate.decide(RequestInputs(speculative_algorithm="ngram"))
    assert d.num_speculative_tokens is None  # another algorithm gets its own default length, not eagle's
    with pytest.raises(PolicyError, match="speculative_algorithm"):
        gate.decide(RequestInputs(speculative_algorithm="medusa"))
    # the engine's own limits, from the one table (specgate.algorithms): eagle goes to 10, ngram to 16
    with pytest.raises(PolicyError, match=r"num_speculative_tokens for eagle must be in 1\.\.10"):
        gate.decide(RequestInputs(speculative_algorithm="eagle", num_speculative_tokens=11))
    assert gate.decide(RequestInputs(speculative_algorithm="ngram", num_speculative_tokens=16)).num_speculative_tokens == 16


def test_temperature_gate(gate: Gate) -> None:
    assert decide(gate, temperature=0.70)[1] == "prod"  # not above the threshold
    assert decide(gate, temperature=0.71) == ("baseline", "temperature", False)
    assert decide(gate, temperature=None)[1] == "prod"
    assert decide(gate, api_key=KEY_B, temperature=1.0)[1] == "shadow"  # tenant threshold 1.2
    assert decide(gate, api_key=KEY_A, temperature=2.0)[1] == "mode_off"  # mode_off comes first


def test_canary_is_deterministic_and_close_to_its_percentage(tmp_path: Path) -> None:
    g = make_gate(tmp_path, "mode: prod\ncanary_percent: 30\nload: {max_in_flight: null}\nallow_override: true\n")
    first = [decide(g, request_id=f"req-{i}")[1] for i in range(4000)]
    again = [decide(g, request_id=f"req-{i}")[1] for i in range(4000)]
    assert first == again and set(first) == {"canary_in", "canary_out"}
    assert abs(first.count("canary_in") / 4000 - 0.30) < 0.03
    # requests without an id split by their content's digest; an explicit request for prod skips the canary
    anon = [decide(g, canary_key=f"content-{i}")[1] for i in range(1000)]
    assert 0.2 < anon.count("canary_in") / 1000 < 0.4
    assert {decide(g, request_id=f"req-{i}", spec_header="prod")[1] for i in range(200)} == {"prod"}


def test_canary_is_the_same_on_every_replica(tmp_path: Path) -> None:
    """Two gates (two replicas behind a load balancer) with different histories put every request on
    the same side: the decision comes from the request (its id, else its content digest), not from
    a process's counter or state."""
    policy = "mode: prod\ncanary_percent: 50\nload: {max_in_flight: null}\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = make_gate(tmp_path / "a", policy), make_gate(tmp_path / "b", policy)
    for i in range(37):  # b has served other requests first
        decide(b, canary_key=f"other-{i}")
    keys = [{"canary_key": f"content-{i}"} for i in range(200)] + [{"request_id": f"id-{i}", "canary_key": "same"} for i in range(200)]
    on_a = [decide(a, **k)[1] for k in keys]
    assert on_a == [decide(b, **k)[1] for k in keys]
    assert set(on_a[:200]) == set(on_a[200:]) == {"canary_in", "canary_out"}  # the id, when there is one, decides


def test_content_digest_follows_the_request() -> None:
    from specgate.serving.llm_request import content_digest

    base = {"max_tokens": 16, "temperature": 0.5, "seed": 7, "api_key": "k", "request_id": "", "canary_key": ""}
    assert content_digest([1, 2, 3], base) == content_digest([1, 2, 3], dict(reversed(base.items())))
    assert content_digest([1, 2, 3], base) != content_digest([1, 2, 4], base)
    assert content_digest([1, 2, 3], base) != content_digest([1, 2, 3], {**base, "seed": 8})
    assert content_digest([1, 2, 3], base) == content_digest([1, 2, 3], {**base, "request_id": "x", "top_k": None})


def test_canary_bounds(tmp_path: Path) -> None:
    zero = make_gate(tmp_path, "mode: prod\ncanary_percent: 0\n")
    assert {decide(zero, request_id=str(i))[1] for i in range(200)} == {"canary_out"}


def test_load_gate_counts_in_flight(gate: Gate) -> None:
    held = [gate.decide(RequestInputs()) for _ in range(3)]
    assert [d.reason for d in held] == ["prod"] * 3
    assert gate.in_flight == 3
    d = gate.decide(RequestInputs())
    assert (d.route, d.reason) == ("baseline", "load")
    for x in [*held, d]:
        gate.finish(x)
    assert gate.in_flight == 0 and decide(gate)[1] == "prod"


def test_shadow_mirrors_are_bounded_and_dropped_when_busy(gate: Gate) -> None:
    first = gate.decide(RequestInputs(spec_header="shadow"))
    assert (first.route, first.reason, first.shadow) == ("baseline", "shadow", True)
    busy = gate.decide(RequestInputs(spec_header="shadow"))
    assert (busy.route, busy.reason, busy.shadow) == ("baseline", "shadow_busy", False)
    gate.end_shadow(first, mismatch=False)
    for d in (first, busy):
        gate.finish(d)
    assert decide(gate, spec_header="shadow") == ("baseline", "shadow", True)


def test_breaker_routes_and_probes(tmp_path: Path) -> None:
    clock = Clock()
    g = make_gate(tmp_path, clock=clock)
    for _ in range(2):
        d = g.decide(RequestInputs(api_key="stranger"))
        g.record_speculative(d, SpecStats(draft_tokens=10, accepted_tokens=0))
        g.finish(d)
    assert g.breakers.snapshot("org").state is BreakerState.OPEN
    assert decide(g) == ("baseline", "circuit_open", False)
    assert decide(g, use_speculative_decoding=True)[1] == "circuit_open"  # opting in does not bypass it
    clock.t = 5.0
    probe = g.decide(RequestInputs())
    assert (probe.route, probe.reason, probe.probe) == ("speculative", "half_open_probe", True)
    assert decide(g)[1] == "circuit_open"  # probe_fraction 0.5: every other request
    g.record_speculative(probe, SpecStats(draft_tokens=10, accepted_tokens=9))
    g.finish(probe)
    assert g.breakers.snapshot("org").state is BreakerState.CLOSED
    assert decide(g)[1] == "prod"


def test_engine_failures_open_the_tenant_breaker_only(gate: Gate) -> None:
    tenant = gate.decide(RequestInputs(api_key=KEY_A, spec_header="prod"))
    for _ in range(3):
        gate.record_failure(tenant, Route.SPECULATIVE)
    gate.finish(tenant)
    assert decide(gate, api_key=KEY_A, spec_header="prod")[1] == "circuit_open"
    assert decide(gate)[1] == "prod"  # the org bucket is untouched
    org = gate.decide(RequestInputs())
    for _ in range(5):
        gate.record_failure(org, "baseline")  # baseline failures do not count against speculation
    gate.finish(org)
    assert decide(gate)[1] == "prod"


def test_reload_changes_decisions_without_restart(tmp_path: Path) -> None:
    clock = Clock()
    g = make_gate(tmp_path, "mode: prod\n", clock)
    assert decide(g)[1] == "prod"
    path = tmp_path / "policy.yaml"
    path.write_text("mode: off\n")
    os.utime(path, (10, 10))
    clock.t = 2.0
    assert decide(g)[1] == "mode_off"


def test_reason_codes_are_the_documented_set() -> None:
    assert REASONS == (
        "mode_off", "temperature", "calibrating", "canary_out", "load", "no_gain", "circuit_open", "shadow", "shadow_busy",
        "half_open_probe", "gain_probe", "canary_in", "prod",
    )


def test_load_gate_is_atomic_across_threads(gate: Gate) -> None:
    barrier = threading.Barrier(12)
    decisions: list[Decision] = []

    def worker() -> None:
        barrier.wait()
        decisions.append(gate.decide(RequestInputs()))

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(d.reason for d in decisions) == ["load"] * 9 + ["prod"] * 3  # max_in_flight: 3
    for d in decisions:
        gate.finish(d)
    assert gate.in_flight == 0


def test_adapter_types_fit_the_protocols(gate: Gate) -> None:
    # The adapter passes its LLMRequest and the engines' SpecStats straight in (duck-typed).
    from specgate.serving.llm_request import LLMRequest
    from specgate.stats import SpecStats as EngineStats

    d = gate.decide(LLMRequest(spec_header="prod", api_key=KEY_B, request_id="r1", temperature=0.3))
    assert (d.route, d.reason, d.tenant) == ("speculative", "prod", TenantLabels(SECRET)("team-b"))
    gate.record_speculative(d, EngineStats(draft_tokens=8, accepted_tokens=6))  # tensorrtllm: no drafts
    gate.finish(d)
    assert gate.breakers.snapshot("team-b").ema == pytest.approx(0.75)


# -- routing on spec_engine's calibration -------------------------------------------------------------
def _calibration(ratios: dict[int, float], draft_ms: dict[str, float]) -> Calibration:
    from specgate.machine import machine

    curve = CostCurve.of_ratios(ratios, base_ms=10.0)
    return Calibration.build(curve, draft_ms, set(), machine=machine(), backend="llamacpp", dtype="Q4_1", threads=2, measured_at="now")


STEEP = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 8: 4.5, 16: 8.0, 32: 15.0}  # llama.cpp on an AVX2 CPU, roughly
MILD = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0, 16: 3.0, 32: 5.0}  # llama.cpp on a 2-core EPYC (issue 24's true curve)
FLAT = {1: 1.0, 32: 1.0}


def test_auto_picks_the_algorithm_the_calibration_expects_fastest(tmp_path: Path) -> None:
    policy = "mode: prod\nload: {max_in_flight: null}\n"
    # where verification is dear only free drafting can pay: prompt lookup, not an EAGLE head costing 8 ms a step
    mild = make_gate(tmp_path, policy, calibration=_calibration(MILD, {"ngram": 0.05, "eagle2": 8.0, "hybrid": 8.0}))
    d = mild.decide(RequestInputs())
    assert (d.route, d.reason, d.algorithm) == ("speculative", "prod", "ngram")
    # where verification is free, the head's deeper trees win
    flat = make_gate(tmp_path, policy, calibration=_calibration(FLAT, {"ngram": 0.05, "eagle2": 2.0, "hybrid": 2.0}))
    assert flat.decide(RequestInputs()).algorithm == "hybrid"


def test_an_algorithm_that_cannot_pay_is_not_routed_unless_asked_for(tmp_path: Path) -> None:
    linear = {t: float(t) for t in (1, 2, 4, 8, 16, 32)}
    g = make_gate(tmp_path, "mode: prod\nallow_override: true\nload: {max_in_flight: null}\n",
                  calibration=_calibration(linear, {"ngram": 0.05}))
    assert decide(g) == ("baseline", "no_gain", False)
    assert decide(g, spec_header="prod")[:2] == ("speculative", "prod")  # opted in: the engine drafts what pays (nothing)


def test_nothing_goes_to_a_spec_engine_that_is_measuring(tmp_path: Path) -> None:
    """spec_engine withdraws its calibration at load and serves nothing until it has measured and
    published a new one: meanwhile the gate routes to the baseline, opted-in requests too, and it
    looks for the file at every request, so the first one after it appears is routed on it."""
    (tmp_path / "keys.yaml").write_text(KEYS)
    (tmp_path / "policy.yaml").write_text("mode: prod\nallow_override: true\nload: {max_in_flight: null}\n")
    published, clock = tmp_path / "calibration.json", Clock()
    g = Gate(str(tmp_path / "policy.yaml"), now=clock, label_secret=SECRET, calibration_path=published)
    assert decide(g) == ("baseline", "calibrating", False)
    assert decide(g, spec_header="prod")[:2] == ("baseline", "calibrating")
    assert decide(g, temperature=5.0)[1] == "temperature"  # the rules before it still come first
    _calibration(FLAT, {"ngram": 0.05}).save(published)
    assert decide(g)[:2] == ("speculative", "prod")  # no reload interval waited for
    Calibration.withdraw(published)  # the engine restarted
    clock.t += 1.0  # a published calibration is looked at once per reload interval
    assert decide(g)[:2] == ("baseline", "calibrating")
    # no path: policy alone
    assert Gate(str(tmp_path / "policy.yaml"), now=clock, label_secret=SECRET).decide(RequestInputs()).reason == "prod"


def test_a_tenant_the_curve_expects_no_gain_for_is_probed_before_it_is_routed(tmp_path: Path) -> None:
    """On a steep curve n-gram drafting pays only above its prior acceptance: a new tenant is not
    routed on faith. Its breaker starts half-open: probes measure it, the rest go to the baseline."""
    policy = "mode: prod\nallow_override: true\nload: {max_in_flight: null}\nbreaker: {probe_fraction: 0.5, probe_samples: 2}\n"
    cal = _calibration(STEEP, {"ngram": 0.05})
    assert cal.algorithms["ngram"].break_even_alpha is not None  # it can pay, at some acceptance
    g = make_gate(tmp_path, policy, calibration=cal)
    assert [decide(g)[:2] for _ in range(3)] == [("speculative", "half_open_probe"), ("baseline", "no_gain"),
                                                 ("speculative", "half_open_probe")]
    assert decide(g, spec_header="prod")[:2] == ("speculative", "prod")  # opted in: not judged
    for _ in range(2):  # the probes show high acceptance and a real gain: the tenant is routed from now on
        d = g.decide(RequestInputs(spec_header="prod"))
        g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=50, accepted_tokens=48, modelled_speedup=1.6))
        g.finish(d)
    assert g.breakers.snapshot("org").state is BreakerState.CLOSED
    assert decide(g)[:2] == ("speculative", "prod")
    # on a curve where the prior pays, a new tenant is routed from its first request
    assert decide(make_gate(tmp_path, policy, calibration=_calibration(MILD, {"ngram": 0.05})))[:2] == ("speculative", "prod")


def test_algorithms_the_engine_lacks_are_refused(tmp_path: Path) -> None:
    g = make_gate(tmp_path, "mode: prod\n", calibration=_calibration(STEEP, {"ngram": 0.05, "draft_model": 3.0}))
    with pytest.raises(PolicyError, match="eagle2 is not available on this server .*EAGLE head.*available: ngram, draft_model"):
        g.decide(RequestInputs(speculative_algorithm="eagle2"))


def test_auto_breaker_thresholds_are_the_calibrated_break_even(tmp_path: Path) -> None:
    cal = _calibration(MILD, {"ngram": 0.05})
    g = make_gate(tmp_path, "mode: prod\nbreaker: {min_samples: 2, ema_weight: 1.0}\nload: {max_in_flight: null}\n", calibration=cal)
    be = cal.break_even_rate("ngram")
    assert be is not None and 0.01 < be < 0.6
    for rate in (be * 1.1, be * 1.1):  # just above: stays closed
        d = g.decide(RequestInputs())
        g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=1000, accepted_tokens=round(1000 * rate)))
        g.finish(d)
    assert g.breakers.snapshot("org").state is BreakerState.CLOSED
    d = g.decide(RequestInputs())
    g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=1000, accepted_tokens=round(1000 * be * 0.9)))
    g.finish(d)
    assert g.breakers.snapshot("org").state is BreakerState.OPEN


def test_a_tenant_whose_acceptance_buys_less_than_min_gain_goes_speculative_only_to_be_measured(tmp_path: Path) -> None:
    """Above break-even the breaker stays closed, but the route is taken only where the curve expects
    `min_gain` at the tenant's own acceptance: below that, one request in `probe_fraction` goes
    speculative to keep measuring it (gain_probe) and the rest go to the baseline (no_gain). When its
    acceptance comes back, so does the route."""
    from specgate.algorithms import ALGORITHMS
    from specgate.cost_model.goodput import alpha_of_rate

    cal = _calibration(MILD, {"ngram": 0.05})
    policy = ("mode: prod\nallow_override: true\nbreaker: {min_samples: 2, ema_weight: 1.0, min_gain: 1.2, probe_fraction: 0.25}\n"
              "load: {max_in_flight: null}\n")
    g = make_gate(tmp_path, policy, calibration=cal)
    depth = ALGORITHMS["ngram"].default_depth
    be = cal.break_even_rate("ngram")
    assert be is not None
    # a rate above break-even whose expected gain is short of min_gain
    short = next(r / 100 for r in range(int(100 * be) + 2, 100) if 1.0 < cal.speedup("ngram", alpha_of_rate(r / 100, depth)) < 1.15)
    high = 0.95
    assert cal.speedup("ngram", alpha_of_rate(high, depth)) > 1.2

    def served(rate: float) -> None:
        d = g.decide(RequestInputs(spec_header="prod"))  # opted in: always served, never judged
        assert (d.route, d.reason) == ("speculative", "prod")
        g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=1000, accepted_tokens=round(1000 * rate)))
        g.finish(d)

    for _ in range(2):
        served(short)
    assert g.breakers.snapshot("org").state is BreakerState.CLOSED  # above break-even
    reasons = [decide(g)[:2] for _ in range(8)]
    probe, skip = ("speculative", "gain_probe"), ("baseline", "no_gain")
    assert reasons == [probe, skip, skip, skip, probe, skip, skip, skip]
    served(high)
    assert decide(g)[:2] == ("speculative", "prod")


def test_a_tenants_gain_is_judged_per_prompt_length_class(tmp_path: Path) -> None:
    """One tenant sends summaries of long documents, where drafting pays, and short chat turns, where
    it does not: each prompt-length class is routed on what the tenant's requests of that class
    bought, so neither drags the other across min_gain. A class without evidence of its own is
    judged on the tenant's whole gain."""
    policy = ("mode: prod\nallow_override: true\nload: {max_in_flight: null}\n"
              "breaker: {ema_weight: 0.5, min_gain: 1.05, probe_fraction: 0.25, gain_prompt_classes: [100, 1000]}\n")
    g = make_gate(tmp_path, policy, calibration=_calibration(MILD, {"ngram": 0.05}))
    long_, short, huge = 500, 20, 3000

    def served(prompt_tokens: int, gain: float) -> None:
        d = g.decide(RequestInputs(spec_header="prod", prompt_tokens=prompt_tokens))  # opted in: served, not judged
        g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=20, accepted_tokens=10, modelled_speedup=gain))
        g.finish(d)

    for prompt_tokens, gain in [(long_, 1.4)] * 3 + [(short, 0.9)] * 3:
        served(prompt_tokens, gain)
    whole = g.breakers.snapshot("org").gain
    assert whole is not None and whole < 1.05  # the tenant as a whole: short of min_gain
    assert [decide(g, prompt_tokens=long_)[:2] for _ in range(3)] == [("speculative", "prod")] * 3
    probe, skip = ("speculative", "gain_probe"), ("baseline", "no_gain")
    assert [decide(g, prompt_tokens=short)[:2] for _ in range(5)] == [probe, skip, skip, skip, probe]
    assert [decide(g, prompt_tokens=huge)[:2] for _ in range(2)] == [probe, skip]  # no evidence: the tenant's gain
    for _ in range(2):  # the short prompts start to pay: their route comes back
        served(short, 1.3)
    assert decide(g, prompt_tokens=short)[:2] == ("speculative", "prod")



def test_a_class_that_paid_for_other_tenants_admits_a_new_tenant_and_never_holds_one_back(tmp_path: Path) -> None:
    """On a steep curve n-gram's prior does not pay, so a new tenant starts half-open (one probe, then
    no_gain). Once other tenants' long prompts bought min_gain, a new tenant's long prompts go
    speculative at once; its short prompts, where no tenant has shown a gain, are still judged by the
    prior. Evidence that a class does not pay holds no one back where the prior pays."""
    policy = ("mode: prod\nallow_override: true\nkey_file: keys.yaml\nload: {max_in_flight: null}\n"
              "breaker: {ema_weight: 0.5, min_gain: 1.03, probe_fraction: 0.25, probe_samples: 3, gain_prompt_classes: [100, 1000]}\n"
              "tenants:\n  team-a: {}\n  team-b: {}\n")
    long_, short = 500, 20

    def served(g: Gate, key: str, prompt_tokens: int, gain: float) -> None:
        d = g.decide(RequestInputs(spec_header="prod", prompt_tokens=prompt_tokens, api_key=key))  # opted in: not judged
        g.record_speculative(d, SpecStats(num_drafts=10, draft_tokens=20, accepted_tokens=10, modelled_speedup=gain))
        g.finish(d)

    steep = make_gate(tmp_path, policy, calibration=_calibration(STEEP, {"ngram": 0.05}))
    for _ in range(2):
        served(steep, KEY_A, long_, 1.3)
    assert decide(steep, prompt_tokens=long_, api_key=KEY_B)[:2] == ("speculative", "half_open_probe")  # 2 < probe_samples: the prior
    served(steep, KEY_A, long_, 1.3)
    assert [decide(steep, prompt_tokens=long_, api_key=KEY_B)[:2] for _ in range(3)] == [("speculative", "prod")] * 3
    assert decide(steep, prompt_tokens=short, api_key=KEY_B)[:2] == ("baseline", "no_gain")  # half-open since its first request

    mild = make_gate(tmp_path, policy, calibration=_calibration(MILD, {"ngram": 0.05}))
    for _ in range(3):
        served(mild, KEY_A, short, 0.8)
    assert decide(mild, prompt_tokens=short, api_key=KEY_B)[:2] == ("speculative", "prod")
