"""EAGLE training plumbing on a tiny random target: the feature cache resumes without gaps or
repeats, epochs cover every sample once, and each chain level's loss is aimed at the right feature
and token."""

from __future__ import annotations

from pathlib import Path

import torch

from build import eagle_features
from build.eagle_data import Sample
from build.train_eagle import batches, loss_fn, make_batch
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig
from tests.unit.tiny_model import TINY, tiny_target


def _samples(n: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [Sample(i, torch.randint(3, 300, (int(torch.randint(12, 40, (1,), generator=g)),), generator=g).tolist(), 5) for i in range(n)]


def test_feature_cache_resumes_in_stream_order(tmp_path: Path) -> None:
    target, samples = tiny_target(torch.bfloat16), _samples(12)
    eagle_features.extract(target, iter(samples), 150, tmp_path, shard_tokens=100)  # stops part-way
    first = eagle_features.load(tmp_path)
    assert 150 <= first.tokens < sum(len(s.ids) for s in samples)
    eagle_features.extract(target, iter(samples), 10_000, tmp_path, shard_tokens=100)  # resumes
    fs = eagle_features.load(tmp_path)
    assert [fs.ids[o : o + n].tolist() for o, n, _ in fs.spans] == [s.ids for s in samples]
    assert [st for _, _, st in fs.spans] == [s.start for s in samples]
    f, g = eagle_features.target_features(target, samples[7].ids)
    o, n, _ = fs.spans[7]
    assert torch.equal(fs.feats[o : o + n], f) and torch.equal(fs.greedy[o : o + n], g)


def test_an_epoch_covers_every_sample_once() -> None:
    spans = [(0, int(n), 1) for n in torch.randint(10, 300, (200,), generator=torch.Generator().manual_seed(2))]
    ep = batches(spans, epoch=3, seed=0, batch_tokens=512)
    assert sorted(i for b in ep for i in b) == list(range(200))
    assert all(len(b) == 1 or sum(spans[i][1] for i in b) <= 512 for b in ep)
    assert ep != batches(spans, epoch=4, seed=0, batch_tokens=512)  # reshuffled per epoch


def test_levels_are_aimed_at_the_right_feature_and_token(tmp_path: Path) -> None:
    """Level j at base p must regress f_{p+j+1} and predict the target's greedy token there: a
    'head' that outputs exactly that feature gets zero regression loss and full top-1."""
    target, samples = tiny_target(torch.bfloat16), _samples(3)
    eagle_features.extract(target, iter(samples), 10_000, tmp_path)
    fs = eagle_features.load(tmp_path)
    d2t = torch.arange(300)
    head = EagleHead(EagleHeadConfig.from_target(TINY, 300), target.embed.weight, target.lm_head.weight, d2t).float()
    levels = 3
    batch = make_batch(fs, [0, 1, 2], d2t, levels)
    L = batch["base"].shape[1]

    def oracle(features: torch.Tensor, input_ids: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [batch["feats"][:, j + 1 : j + 1 + L].float() for j in range(n)]

    head.forward_levels = oracle  # type: ignore[method-assign]
    loss, m = loss_fn(head, batch, ce_weight=0.0, levels=levels)
    assert float(loss) == 0.0 and m["acc"] > 0.95
    # level-0 positions trained: pairs after the prompt (start - 1 .. n - 2) of each sample
    assert m["tokens"] == sum(len(s.ids) - 1 - (s.start - 1) for s in samples)

    def off_by_one(features: torch.Tensor, input_ids: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [batch["feats"][:, j : j + L].float() for j in range(n)]

    head.forward_levels = off_by_one  # type: ignore[method-assign]
    loss, m = loss_fn(head, batch, ce_weight=0.0, levels=levels)
    assert float(loss) > 0.1 and m["acc"] < 0.5
