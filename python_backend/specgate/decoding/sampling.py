"""Sampling parameters and the logits -> probabilities warp shared by the baseline and the verifier.

Speculative sampling is only exact if the draft's q and the target's p are warped the same way as
baseline sampling warps p, so there is one `warp` function for all of them.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import Tensor

from specgate.contract import SAMPLING_EPS


class SamplingParams(BaseModel):
    temperature: float = Field(0.0, ge=0.0, description="below SAMPLING_EPS (1e-5) = greedy")
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def generator(self) -> torch.Generator:
        """A per-request RNG: a request's samples never depend on what else is running."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def warp(logits: Tensor | np.ndarray, p: SamplingParams) -> Tensor:
    """Probabilities after temperature, top-k and top-p, over the last dim (float32)."""
    logits = torch.as_tensor(logits).float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: Tensor, gen: torch.Generator) -> int:
    """One index drawn from the distribution `probs` [V] (any positive scale): by inverting its CDF
    at one uniform draw, accumulated in float64.

    By hand because torch.multinomial over a 49152-token vocabulary took about 1 ms a draw on these
    CPUs (with or without replacement), a tenth of a llama.cpp decode step; this takes a tenth of that.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # cdf[i-1] <= u < cdf[i]: probs[i] > 0
    if i >= probs.numel():  # u rounded up to the total: the last index with mass
        i = int(torch.nonzero(probs).max())
    return i


def greedy_tokens(logits: Tensor | np.ndarray) -> list[int]:
    """The argmax of each [..., V] logits row (the first index of the maximum, as torch.argmax gives).

    Through NumPy for float32 rows because torch.argmax over a 49152-token vocabulary took about
    0.09 ms a row on these CPUs (0.6 ms for a verification of 8), 3-20% of a llama.cpp decode step;
    NumPy takes a twentieth of that. A target's rows are NumPy already (decoding/target.py).
    """
    rows = logits if isinstance(logits, np.ndarray) else logits.float().numpy()  # .float(): no copy for float32
    return rows.argmax(-1).reshape(-1).tolist()


def sample_token(logits: Tensor | np.ndarray, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from a [V] logits row (a target's NumPy row, or a tensor): argmax when greedy, else a
    draw from `warp`."""
    if p.greedy:
        return greedy_tokens(logits)[0]
    return draw(warp(logits, p), gen)
