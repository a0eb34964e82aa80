"""sampling.greedy_tokens, the argmax every greedy path takes: torch.argmax's answer, ties included."""

from __future__ import annotations

import torch

from specgate.decoding.sampling import greedy_tokens


def test_rows_match_torch_argmax_with_ties_to_the_first_index() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=gen)
    logits[3, 100] = logits[3, 4000] = 1e4  # a tie: the first index wins, as in torch.argmax
    logits[5, 7] = float("inf")
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[3] == 100
    assert greedy_tokens(logits[2]) == [int(logits[2].argmax())]
    assert greedy_tokens(logits.numpy()) == logits.argmax(-1).tolist()  # a target's NumPy rows too


def test_non_float32_and_strided_rows() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    half = logits.to(torch.bfloat16)
    assert greedy_tokens(half) == half.float().argmax(-1).tolist()
    every_other = logits[::2, 1:]  # a view, not contiguous
    assert greedy_tokens(every_other) == every_other.argmax(-1).tolist()
