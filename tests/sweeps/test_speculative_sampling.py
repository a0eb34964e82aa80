"""End-to-end sampling losslessness of the generator, on tiny random models (no checkpoint).

With a 4-token vocabulary the exact target distribution of the first three generated tokens is
enumerable (64 sequences), so the generator's samples, for every drafter, are checked against it by
chi-square: drafting, verification rows, KV-cache compaction and drafter rollback all take part.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specgate.decoding.model import KVCache, Llama, LlamaConfig
from specgate.decoding.sampling import SamplingParams, warp
from specgate.decoding.torch_target import TorchTarget
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.draft_model import DraftModelDrafter
from specgate.speculative.drafter import Drafter
from specgate.speculative.eagle import EagleDrafter
from specgate.speculative.eagle2 import Eagle2Drafter
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig
from specgate.speculative.hybrid import HybridDrafter
from specgate.speculative.ngram import NgramDrafter
from tests.unit.stat_helpers import passes_chi2

V, NEW, TRIALS, MAX_LEN = 4, 3, 2500, 64
PROMPT = [0, 1, 2, 3, 0, 1]  # repeats, so n-gram lookup finds matches
PARAMS = SamplingParams(temperature=1.0, top_k=3)  # top-k: p and q both warped, with zero cells


def _tiny_llama(seed: int) -> Llama:
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=-1, max_position_embeddings=MAX_LEN,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Llama(cfg, MAX_LEN)
        model.embed.weight.data.normal_(0, 1.0)
    return model.eval()


@pytest.fixture(scope="module")
def target() -> Llama:
    return _tiny_llama(0)


def _drafter(name: str, target: Llama) -> Drafter:
    if name == "ngram":
        return NgramDrafter()
    if name == "draft_model":
        return DraftModelDrafter(TorchTarget(_tiny_llama(1), MAX_LEN, 1), V)
    if name == "draft_model_is_target":  # q == p: every draft is accepted, bonus from the last row
        return DraftModelDrafter(TorchTarget(target, MAX_LEN, 1), V)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        cfg = EagleHeadConfig.from_target(target.cfg, draft_vocab_size=V)
        head = EagleHead(cfg, target.embed.weight, target.lm_head.weight, torch.arange(V)).eval()
    if name == "eagle":
        return EagleDrafter(head, V, MAX_LEN)
    tree = Eagle2Drafter(head, V, MAX_LEN, depth=3, top_k=2)
    return tree if name == "eagle2" else HybridDrafter(tree, NgramDrafter())


def _exact(target: Llama) -> torch.Tensor:
    """P(first NEW tokens = s) for every s in V^NEW, by enumeration."""
    probs = torch.zeros([V] * NEW)
    for seq in itertools.product(range(V), repeat=NEW):
        ids = torch.tensor([PROMPT + list(seq)])
        cache = KVCache(target.cfg, 1, ids.shape[1], torch.float32)
        rows = warp(target.logits(target(ids, cache, torch.zeros(1, dtype=torch.long), torch.tensor([0]))[0]), PARAMS)
        probs[seq] = torch.stack([rows[len(PROMPT) - 1 + i, t] for i, t in enumerate(seq)]).prod()
    return probs


@pytest.mark.parametrize("name", ["ngram", "draft_model", "draft_model_is_target", "eagle", "eagle2", "hybrid"])
def test_generator_samples_follow_target(target: Llama, name: str) -> None:
    drafter = _drafter(name, target)
    gen = SpeculativeGenerator(TorchTarget(target, MAX_LEN, 1), {drafter.name: drafter})
    counts = torch.zeros([V] * NEW)
    drafted = 0
    for seed in range(TRIALS):
        params = PARAMS.model_copy(update={"seed": seed})
        stream = gen.generate(PROMPT, NEW, params=params, algorithm=drafter.name, k=3, end_id=-1)
        out = tuple(t for block in stream for t in block)
        counts[out] += 1
        drafted += stream.stats.draft_tokens
    assert drafted > 0
    assert passes_chi2(counts, _exact(target))
