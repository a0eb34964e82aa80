"""EagleHead: shapes, the file round trip, and that the cached serving path equals training's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from specgate.decoding.model import KVCache, Llama, load_llama
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig, greedy_chain, load_eagle_head, save_eagle_head
from tests.conftest import HEAD as SHIPPED_HEAD
from tests.unit.tiny_model import tiny_target

CHECKPOINT = Path(__file__).resolve().parents[2] / "artifacts/checkpoints/smollm2-135m-instruct"


def _head(target: Llama, draft_vocab: int = 50) -> EagleHead:
    torch.manual_seed(1)
    d2t = torch.randperm(target.cfg.vocab_size)[:draft_vocab]
    return EagleHead(EagleHeadConfig.from_target(target.cfg, draft_vocab), target.embed.weight, target.lm_head.weight, d2t).eval()


def test_shapes_and_draft_vocab() -> None:
    target = tiny_target()
    head = _head(target)
    feats, ids = torch.randn(2, 7, 64), torch.randint(0, 300, (2, 7))
    h = head.forward_train(feats, ids)
    assert h.shape == (2, 7, 64)
    logits = head.draft_logits(h)
    assert logits.shape == (2, 7, 50) and logits.dtype == torch.float32
    assert int(head.d2t.min()) >= 0 and int(head.d2t.max()) < target.cfg.vocab_size
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.d2t])
    assert not any(k.startswith("embed") for k in head.state_dict())  # the target's table is not ours


def test_cached_steps_equal_forward_train() -> None:
    """Prefill + single-pair steps through the KV cache reproduce the causal training forward."""
    head = _head(tiny_target())
    feats, ids = torch.randn(1, 9, 64), torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        ref = head.forward_train(feats, ids)
        cache = head.new_cache(16, torch.float32)
        got = [head(feats[:, :4], ids[:, :4], cache, 0)]
        got += [head(feats[:, t : t + 1], ids[:, t : t + 1], cache, t) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=1e-5, rtol=1e-5)


def test_levels_equal_serving_chains() -> None:
    """Training-time test: level j of forward_levels is what a serving chain from the same base pair
    computes at step j (true prefix in the cache, its own features fed back, true tokens)."""
    head = _head(tiny_target())
    L, levels = 8, 3
    feats, ids = torch.randn(1, L, 64), torch.randint(0, 300, (1, L + levels - 1))
    with torch.no_grad():
        out = head.forward_levels(feats, ids, levels)
        for p in range(L):
            cache = head.new_cache(32, torch.float32)
            h = head(feats[:, : p + 1], ids[:, : p + 1], cache, 0)[:, -1:]
            torch.testing.assert_close(h, out[0][:, p : p + 1], atol=1e-5, rtol=1e-5)
            for j in range(1, levels):
                h = head(h, ids[:, p + j : p + j + 1], cache, p + j)
                torch.testing.assert_close(h, out[j][:, p : p + 1], atol=1e-5, rtol=1e-5)


def test_greedy_chain_feeds_back_its_features() -> None:
    head = _head(tiny_target())
    feats, ids = torch.randn(1, 5, 64), torch.randint(0, 300, (1, 5))
    cache = head.new_cache(16, torch.float32)
    head(feats[:, :4], ids[:, :4], cache, 0)
    draft = greedy_chain(head, feats[:, 4:], int(ids[0, 4]), cache, 4, k=3)
    # the same chain by hand, from the training forward over the growing sequence
    f, x = feats.clone(), ids.clone()
    with torch.no_grad():
        for tok in draft:
            h = head.forward_train(f, x)[:, -1:]
            assert int(head.d2t[head.draft_logits(h[0, -1]).argmax()]) == tok
            f, x = torch.cat([f, h], 1), torch.cat([x, torch.tensor([[tok]])], 1)


def test_save_load_round_trip(tmp_path: Path) -> None:
    target = tiny_target()
    head = _head(target)
    save_eagle_head(head, tmp_path)
    stored = (tmp_path / "eagle_head.safetensors").stat().st_size
    assert stored < 4 * sum(p.numel() for n, p in head.named_parameters() if not n.startswith("lm_head")) + 4096
    loaded = load_eagle_head(tmp_path, target.embed.weight, target.lm_head.weight, torch.float32)
    feats, ids = torch.randn(1, 6, 64), torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_train(feats, ids), head.forward_train(feats, ids))
    assert torch.equal(loaded.d2t, head.d2t)


@pytest.mark.skipif(not CHECKPOINT.exists(), reason="target checkpoint missing: run `python -m build.fetch_model`")
def test_real_target_head(tmp_path: Path) -> None:
    target = load_llama(CHECKPOINT, torch.float32, max_len=64)
    d2t = torch.arange(8192)
    head = EagleHead(EagleHeadConfig.from_target(target.cfg, 8192), target.embed.weight, target.lm_head.weight, d2t).eval()
    save_eagle_head(head.to(torch.bfloat16), tmp_path)
    assert (tmp_path / "eagle_head.safetensors").stat().st_size < 12_000_000  # fc + one layer + d2t only
    loaded = load_eagle_head(tmp_path, target.embed.weight, target.lm_head.weight, torch.bfloat16)
    assert loaded.embed is target.embed.weight and loaded.cfg.draft_vocab_size == 8192
    assert loaded.lm_head.weight.shape == (8192, target.cfg.hidden_size)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253]])
    feats = target(ids, KVCache(target.cfg, 1, 64, torch.float32), torch.tensor([0]), torch.tensor([0]))
    with torch.no_grad():
        h = loaded(feats[:, :-1], ids[:, 1:], loaded.new_cache(16, torch.bfloat16), 0)
    assert h.shape == (1, 5, target.cfg.hidden_size) and loaded.draft_logits(h).shape == (1, 5, 8192)


@pytest.mark.skipif(not CHECKPOINT.exists(), reason="target checkpoint missing: run `python -m build.fetch_model`")
def test_int8_head_drafts_as_the_float_head() -> None:
    """The served int8 head (quantize_int8) picks the float head's draft at nearly every position of
    real text, keeps `fc` in fp32, and reads a quarter of the float weights' bytes elsewhere."""
    target = load_llama(CHECKPOINT, torch.float32, max_len=256)
    ref = load_eagle_head(SHIPPED_HEAD, target.embed.weight, target.lm_head.weight, torch.float32)
    q = load_eagle_head(SHIPPED_HEAD, target.embed.weight, target.lm_head.weight, torch.float32, int8=True)
    assert isinstance(q.fc, torch.nn.Linear) and q.fc.weight.dtype == torch.float32
    assert all(not isinstance(m, torch.nn.Linear) for m in (q.layer.qkv, q.layer.o, q.layer.gate_up, q.layer.down, q.lm_head))
    assert q.dtype == torch.float32 and torch.equal(q.d2t, ref.d2t)
    text = ("The river rose through the night, and by morning the lower fields were under water. Farmers moved "
            "their animals to the hills, while the town council met to decide whether the old bridge could still "
            "carry the trucks that brought food and fuel. Engineers said the stone piers were sound, but the "
            "wooden deck had rotted in places, so only light vehicles would be allowed to cross until repairs.")
    ids = torch.tensor([Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(text).ids])
    with torch.no_grad():
        feats = target(ids, KVCache(target.cfg, 1, 256, torch.float32), torch.tensor([0]), torch.tensor([0]))
        picks = [head.draft_logits(head.forward_train(feats[:, :-1], ids[:, 1:]))[0].argmax(-1) for head in (ref, q)]
    # 0.91 here; quantizing `fc` as well agreed at 0.53
    assert (picks[0] == picks[1]).float().mean() >= 0.85
    # the greedy pick through draft_token is the argmax, mapped to target ids
    row = torch.randn(8192)
    assert q.draft_token(row) == int(q.d2t[row.argmax()])
