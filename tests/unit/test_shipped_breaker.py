"""The shipped policy's breaker, fed the real per-request acceptance of the engines it gates.

The breaker exists to turn speculation off where it does not pay. With the shipped policy and the
shipped weights (bf16, as served), the policy's default algorithm must keep an ordinary tenant's
circuit closed (it measured faster than the baseline on every category of `make bench-engine`),
and the untrained draft model (measured ~0.6x everywhere) must open it.
"""

from __future__ import annotations

import torch

from specgate.engine.model import load_llama
from specgate.engine.sampling import SamplingParams
from specgate.gate.breaker import BreakerState, CircuitBreakers
from specgate.gate.policy import BreakerPolicy, load_policy
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.registry import build_drafters
from specgate.text.tokenizer import PromptTokenizer
from tests.conftest import DRAFT, HEAD, ROOT
from tests.prompts import GREEDY_PROMPTS

MAX_LEN = 512
NEW_TOKENS = 32


def _breaker_state(
    gen: SpeculativeGenerator, tok: PromptTokenizer, cfg: BreakerPolicy, algorithm: str, k: int | None
) -> tuple[BreakerState, list[float]]:
    breakers = CircuitBreakers(now=lambda: 0.0)
    rates = []
    for prompt in GREEDY_PROMPTS:  # 20 requests: the shipped min_samples
        stream = gen.generate(tok.encode_prompt(prompt), NEW_TOKENS, SamplingParams(), algorithm, k)
        for _ in stream:
            pass
        s = stream.stats
        rates.append(s.accepted_tokens / max(s.draft_tokens, 1))
        breakers.record_acceptance("tenant", s.accepted_tokens, s.draft_tokens, cfg)
    return breakers.snapshot("tenant").state, rates


def test_breaker_stays_closed_where_speculation_pays_and_opens_where_it_does_not(checkpoint):
    policy = load_policy(ROOT / "policy" / "default.yaml")
    assert len(GREEDY_PROMPTS) >= policy.breaker.min_samples
    target = load_llama(checkpoint, torch.bfloat16, MAX_LEN)
    gen = SpeculativeGenerator(target, build_drafters(target, MAX_LEN, DRAFT, HEAD), MAX_LEN)
    tok = PromptTokenizer(checkpoint, MAX_LEN - NEW_TOKENS - 16)

    spec = policy.speculative
    state, rates = _breaker_state(gen, tok, policy.breaker, spec.algorithm, spec.num_speculative_tokens)
    assert state is BreakerState.CLOSED, f"{spec.algorithm} k={spec.num_speculative_tokens} acceptance {rates}"
    state, rates = _breaker_state(gen, tok, policy.breaker, "draft_model", spec.num_speculative_tokens)
    assert state is BreakerState.OPEN, f"draft_model acceptance {rates}"
