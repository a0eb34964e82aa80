"""`attend`'s hand-written decode path equals PyTorch's scaled_dot_product_attention (no model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specgate.decoding.model import attend

H, HKV, D = 9, 3, 64  # SmolLM2-135M's grouping: three query heads per KV head


def _reference(q, keys, values, mask, is_causal=False):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True)


def _batch(seed: int, lens: list[int], dtype: torch.dtype = torch.float32):
    """One new token per sequence over caches of `lens` tokens, padded to the longest, masked."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lens), max(lens)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype) * 3  # sharp attention: a wrong grouping shows
    keys, values = (torch.randn(B, HKV, L, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.arange(L).view(1, 1, 1, -1) < torch.tensor(lens).view(B, 1, 1, 1)
    return q, keys, values, mask


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [[300], [300, 120, 7, 299]])
def test_decode_matches_the_reference(lens, dtype, atol):
    q, keys, values, mask = _batch(0, lens, dtype)
    if len(lens) == 1:
        mask = None  # one sequence: the model passes no mask
    out = attend(q, keys, values, mask, False)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _reference(q.double(), keys.double(), values.double(), mask)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_batched_decode_hides_each_sequences_padding():
    q, keys, values, mask = _batch(1, [40, 7, 25])
    out = attend(q, keys, values, mask, False)
    keys[1, :, 7:] = 1e3  # garbage beyond sequence 1's length must change nothing
    values[1, :, 7:] = 1e3
    torch.testing.assert_close(attend(q, keys, values, mask, False)[1], out[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("B,T,causal", [(1, 6, True), (1, 5, False), (3, 4, False)])
def test_other_shapes_use_the_reference_kernel(B, T, causal):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, T, D, generator=g)
    keys, values = (torch.randn(B, HKV, 6, D, generator=g) for _ in range(2))
    mask = None if causal else torch.rand(B, 1, T, 6, generator=g) > 0.3
    if mask is not None:
        mask[..., 0] = True
    torch.testing.assert_close(attend(q, keys, values, mask, causal), _reference(q, keys, values, mask, causal), atol=0, rtol=0)
