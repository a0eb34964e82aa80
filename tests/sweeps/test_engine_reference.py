"""The CPU engine against transformers' reference implementation of the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from specgate.decoding.model import KVCache
from specgate.decoding.request import GenerationRequest
from specgate.decoding.sampling import SamplingParams
from tests.prompts import GREEDY_PROMPTS
from tests.unit.torch_engine import chat_ids, model, run_all, tok, torch_runner  # noqa: F401 (fixtures)

NEW_TOKENS = 64
# 8 prompts x 64 tokens through both engines: under a minute on a 2-core machine
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def test_logits_match_transformers_fp32(tok, reference, model):
    for text in GREEDY_PROMPTS[:5]:
        ids = torch.tensor([chat_ids(tok, text)])
        cache = KVCache(model.cfg, 1, 1024, torch.float32)
        ours = model.logits(model(ids, cache, torch.tensor([0]), torch.tensor([0])))
        with torch.no_grad():
            ref = reference(ids).logits
        assert (ours - ref).abs().max().item() < 1e-3
        # and a decode step against the cache
        nxt = ref[:, -1:].argmax(-1)
        step = model.logits(model(nxt, cache, torch.tensor([0]), torch.tensor([ids.shape[1]])))
        with torch.no_grad():
            ref2 = reference(torch.cat([ids, nxt], 1)).logits[:, -1:]
        assert (step - ref2).abs().max().item() < 1e-3


def test_greedy_matches_transformers_generate(tok, reference, model, checkpoint):
    """The serving path's greedy tokens (the batch runner: prompts prefilled beside other sequences'
    decodes, slots freed and reused) against transformers' generate, 64 tokens each. 8 prompts on 4
    slots, not 20 on 8 (issue 28: transformers' one-at-a-time generate was most of this test's time,
    54 s with 20 prompts, 74 s with 12 on a slow 2-core EPYC): every slot is still freed and reused
    by a waiting request, and the engine's numbers themselves are checked against transformers'
    logits above."""
    prompts = [chat_ids(tok, t) for t in GREEDY_PROMPTS[:8]]
    # 8 requests share 4 slots: on a busy machine the last ones wait longer than the default 60 s
    runner = torch_runner(checkpoint, model, max_batch_size=4, queue_timeout_s=3600)
    try:
        ours = run_all(runner, [GenerationRequest(input_ids=p, max_new_tokens=NEW_TOKENS, end_id=tok.eos_token_id) for p in prompts])
    finally:
        runner.shutdown()
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        expected = ref[0, len(p) :].tolist()
        if tok.eos_token_id in expected:  # transformers stops at EOS; the engine leaves EOS out
            expected = expected[: expected.index(tok.eos_token_id)]
        assert got == expected, (tok.decode(got), tok.decode(expected))


def test_seeded_sampling_reproducible_and_seed_sensitive(tok, model, checkpoint):
    runner = torch_runner(checkpoint, model, max_batch_size=4)
    ids = chat_ids(tok, "Write a sentence about a dragon.")
    try:
        def req(seed: int) -> GenerationRequest:
            return GenerationRequest(input_ids=ids, max_new_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed))

        a, b, c = run_all(runner, [req(7), req(7), req(8)])
    finally:
        runner.shutdown()
    assert a == b
    assert a != c
