"""The fused EAGLE layer in llama.cpp's CPU backend (build/llamacpp_kernels/eagle_layer.c) against the
PyTorch head: the same arithmetic on a tiny head, the same drafts as the float head on real text."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from specgate.decoding.llamacpp_native import native
from specgate.decoding.model import KVCache, load_llama
from specgate.speculative.eagle_head import EagleHead, EagleHeadConfig, load_eagle_head
from specgate.speculative.eagle_kernel import MAX_ROWS, KernelEagleHead, KernelFunctions, quantize_rows
from tests.conftest import HEAD as SHIPPED_HEAD
from tests.unit.tiny_model import tiny_target

CHECKPOINT = Path(__file__).resolve().parents[2] / "artifacts/checkpoints/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def kernel() -> KernelFunctions:
    import llama_cpp  # noqa: F401  (native() reads the libraries it loads)

    k = KernelFunctions(native().cpu_function)
    assert k.available, "the patched llama.cpp build exports the fused EAGLE layer (make setup)"
    return k


class _EmulatedInt8(nn.Module):
    """The kernel's int8 product in PyTorch: int8 rows and scales, each input row quantized symmetrically
    (x * 127 / max|x|, rounded half to even), exact integer sums, one scale product per output."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.q, self.scale = quantize_rows(weight)

    def forward(self, x: Tensor) -> Tensor:
        amax = x.abs().amax(-1, keepdim=True)
        xq = torch.where(amax > 0, (x * (127 / amax)).round(), 0)
        sums = (xq.double() @ self.q.double().T).float()
        return sums * (self.scale * (amax / 127))


def _emulation(head: EagleHead) -> EagleHead:
    em = copy.deepcopy(head)
    em.fc.weight.data = em.fc.weight.data.bfloat16().float()  # the kernel keeps fc in bf16, as head files hold it
    for parent, name in ((em.layer, "qkv"), (em.layer, "o"), (em.layer, "gate_up"), (em.layer, "down"), (em, "lm_head")):
        setattr(parent, name, _EmulatedInt8(getattr(parent, name).weight))
    return em


def _tiny_head(draft_vocab: int = 50) -> EagleHead:
    target = tiny_target()
    torch.manual_seed(1)
    d2t = torch.randperm(target.cfg.vocab_size)[:draft_vocab]
    return EagleHead(EagleHeadConfig.from_target(target.cfg, draft_vocab), target.embed.weight, target.lm_head.weight, d2t).eval()


def test_the_kernel_computes_the_heads_layer_in_int8(kernel: KernelFunctions) -> None:
    """A prompt's pairs, a chain of single pairs and a tree block under a mask at given positions, through
    the kernel and through the PyTorch layer with the kernel's int8 products: the same features and the
    same K/V in the cache, to float rounding. A draft vocabulary of 50 rows (not a multiple of 4). With
    a helper thread on half of each product's rows (wide enough to split: 64+ rows), the same bits."""
    head = _tiny_head()
    em = _emulation(head)
    fused = KernelEagleHead(copy.deepcopy(head), kernel, max_len=32)
    split = KernelEagleHead(copy.deepcopy(head), kernel, max_len=32, threads=2)
    torch.manual_seed(2)
    feats, ids = torch.randn(1, 12, 64) * 3, torch.randint(0, 300, (1, 12))
    caches = [em.new_cache(32, torch.float32), fused.new_cache(32, torch.float32), split.new_cache(32, torch.float32)]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    with torch.inference_mode():
        for h, cache in zip((em, fused, split), caches):
            out = [h(feats[:, :6], ids[:, :6], cache, 0)]
            out += [h(feats[:, t : t + 1], ids[:, t : t + 1], cache, t) for t in (6, 7)]
            out.append(h(feats[:, 8:], ids[:, 8:], cache, 8, positions=torch.tensor([[8, 9, 9, 10]]), tree_mask=mask))
            h.result = torch.cat(out, dim=1)
            h.logits = h.draft_logits(h.result)
    torch.testing.assert_close(fused.result, em.result, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(fused.logits, em.logits, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(caches[1].k[0, 0, :, :12], caches[0].k[0, 0, :, :12], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(caches[1].v[0, 0, :, :12], caches[0].v[0, 0, :, :12], atol=2e-4, rtol=2e-4)
    assert torch.equal(split.result, fused.result) and torch.equal(split.logits, fused.logits)
    assert torch.equal(caches[2].k, caches[1].k) and torch.equal(caches[2].v, caches[1].v)
    # the control: the float layer is not what the kernel computes
    with torch.inference_mode():
        ref = head(feats[:, :6], ids[:, :6], head.new_cache(32, torch.float32), 0)
    assert not torch.allclose(ref, fused.result[:, :6], atol=2e-4, rtol=2e-4)


def test_a_forked_child_drafts_with_its_own_helper_thread(kernel: KernelFunctions) -> None:
    """fork copies only the calling thread: a child of a process whose helper ran must start its own
    helper, not wait for the parent's forever."""
    fused = KernelEagleHead(_tiny_head(), kernel, max_len=32, threads=2)
    feats, ids = torch.randn(1, 2, 64), torch.randint(0, 300, (1, 2))
    with torch.inference_mode():
        want = fused(feats, ids, fused.new_cache(32, torch.float32), 0)
    pid = os.fork()
    if pid == 0:  # the child: the same product, then out without pytest's teardown
        with torch.inference_mode():
            same = torch.equal(fused(feats, ids, fused.new_cache(32, torch.float32), 0), want)
        os._exit(0 if same else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the kernel")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the child's result differed"


def test_long_blocks_go_through_the_pytorch_head_and_bad_ranges_raise(kernel: KernelFunctions) -> None:
    head = _tiny_head()
    fused = KernelEagleHead(copy.deepcopy(head), kernel, max_len=MAX_ROWS + 8)
    feats, ids = torch.randn(1, MAX_ROWS + 1, 64), torch.randint(0, 300, (1, MAX_ROWS + 1))
    with torch.inference_mode():
        got = fused(feats, ids, fused.new_cache(MAX_ROWS + 8, torch.float32), 0)
        want = fused.fallback(feats, ids, fused.fallback.new_cache(MAX_ROWS + 8, torch.float32), 0)
    torch.testing.assert_close(got, want)
    cache = fused.new_cache(MAX_ROWS + 8, torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        fused(feats[:, :2], ids[:, :2], cache, MAX_ROWS + 7)  # past the cache's last cell
    with pytest.raises(ValueError, match="out of range"):
        fused(feats[:, :1], torch.tensor([[300]]), cache, 0)  # not a token of the vocabulary
    with pytest.raises(ValueError, match="not this head's cache"):
        fused(feats[:, :1], ids[:, :1], fused.fallback.new_cache(MAX_ROWS, torch.float32), 0)
    with pytest.raises(ValueError, match="fp32"):
        KernelEagleHead(_tiny_head().to(torch.bfloat16), kernel, max_len=8)


@pytest.mark.skipif(not CHECKPOINT.exists(), reason="target checkpoint missing: run `python -m build.fetch_model`")
def test_the_kernel_head_drafts_as_the_float_head(kernel: KernelFunctions) -> None:
    """The shipped head through the kernel picks the fp32 head's draft at nearly every position of real
    text, fed in blocks of 16 pairs as a drafter feeds it."""
    target = load_llama(CHECKPOINT, torch.float32, max_len=256)
    ref = load_eagle_head(SHIPPED_HEAD, target.embed.weight, target.lm_head.weight, torch.float32)
    fused = KernelEagleHead(load_eagle_head(SHIPPED_HEAD, target.embed.weight, target.lm_head.weight, torch.float32), kernel, 256)
    text = ("The river rose through the night, and by morning the lower fields were under water. Farmers moved "
            "their animals to the hills, while the town council met to decide whether the old bridge could still "
            "carry the trucks that brought food and fuel. Engineers said the stone piers were sound, but the "
            "wooden deck had rotted in places, so only light vehicles would be allowed to cross until repairs.")
    ids = torch.tensor([Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(text).ids])
    n = ids.shape[1] - 1
    with torch.inference_mode():
        feats = target(ids, KVCache(target.cfg, 1, 256, torch.float32), torch.tensor([0]), torch.tensor([0]))
        picks = []
        for h in (ref, fused):
            cache = h.new_cache(256, torch.float32)
            rows = [h(feats[:, s : min(s + 16, n)], ids[:, s + 1 : s + 17], cache, s) for s in range(0, n, 16)]
            picks.append(h.draft_logits(torch.cat(rows, dim=1))[0].argmax(-1))
    # 0.95 here (PyTorch's int8 head: 0.92)
    assert (picks[0] == picks[1]).float().mean() >= 0.9
