"""The shipped policy's breaker, fed the real per-request acceptance of the engine it gates.

Its thresholds are `auto`: the acceptance below which the request's algorithm stops paying, from
spec_engine's calibration. With this machine's own calibration, the algorithm `auto` picks must keep
an ordinary tenant's circuit closed: the engine drafts only where it expects drafting to pay, so what
it drafts is accepted above break-even. The untrained draft model, whose drafts are almost never
accepted, must open it: it is made to draft every step (a flat, free calibration for the engine),
and judged against this machine's measured break-even.
"""

from __future__ import annotations

from specgate.cost_model.calibration import Calibration
from specgate.cost_model.measure import calibrate
from specgate.cost_model.route import best_algorithm, breaker_thresholds
from specgate.decoding.config import CalibrationOverride, EngineConfig
from specgate.decoding.loading import load_target
from specgate.decoding.sampling import SamplingParams
from specgate.gate.breaker import BreakerState, CircuitBreakers
from specgate.gate.policy import load_policy
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.registry import build_drafters
from specgate.text.tokenizer import PromptTokenizer
from tests.conftest import DRAFT_GGUF, HEAD, ROOT
from tests.prompts import GREEDY_PROMPTS

MAX_LEN = 512
NEW_TOKENS = 32


def _state(gen: SpeculativeGenerator, cal: Calibration, tok: PromptTokenizer, algorithm: str) -> tuple[BreakerState, list[float]]:
    cfg = load_policy(ROOT / "policy" / "default.yaml").breaker.pinned(*breaker_thresholds(cal, algorithm))
    breakers, rates = CircuitBreakers(now=lambda: 0.0), []
    for prompt in GREEDY_PROMPTS:  # 20 requests: the shipped min_samples
        stream = gen.generate(tok.encode_prompt(prompt), NEW_TOKENS, SamplingParams(), algorithm)
        for _ in stream:
            pass
        s = stream.stats
        rates.append(s.accepted_tokens / s.draft_tokens if s.draft_tokens else float("nan"))
        breakers.record_acceptance("tenant", s.accepted_tokens, s.draft_tokens, cfg)
    return breakers.snapshot("tenant").state, rates


def test_auto_keeps_the_circuit_closed_and_free_drafting_opens_it_for_a_bad_drafter(gguf, checkpoint) -> None:  # noqa: ANN001
    policy = load_policy(ROOT / "policy" / "default.yaml")
    assert policy.breaker.open_threshold == "auto" and len(GREEDY_PROMPTS) >= policy.breaker.min_samples
    cfg = EngineConfig(model=gguf, draft_model=DRAFT_GGUF, eagle_head_dir=HEAD, max_context=MAX_LEN)
    target = load_target(cfg, gguf, num_slots=1, tree_nodes=16)
    drafters = build_drafters(target, cfg)
    tok = PromptTokenizer(checkpoint, MAX_LEN - NEW_TOKENS - 16)

    measured = calibrate(target, drafters)
    gen = SpeculativeGenerator(target, drafters, measured.curve)
    auto = best_algorithm(measured, None)
    state, rates = _state(gen, measured, tok, auto)
    assert state is BreakerState.CLOSED, f"{auto} on {measured.summary()}: acceptance {rates}"

    # flat and free at the scale just measured: nothing to measure again
    flat = CalibrationOverride(cost_ratios={1: 1.0, 32: 1.0}, base_ms=measured.curve.cost(1), draft_ms={n: 0.0 for n in drafters})
    free = calibrate(target, drafters, flat)
    gen = SpeculativeGenerator(target, drafters, free.curve)
    for name in free.algorithms:
        gen.draft_cost[name] = free.draft_cost(name)
    state, rates = _state(gen, measured, tok, "draft_model")
    assert state is BreakerState.OPEN, f"draft_model acceptance {rates} on a flat curve"
