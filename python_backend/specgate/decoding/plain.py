"""Plain decoding on a target, one token per forward: the reference speculation must equal."""

from __future__ import annotations

from collections.abc import Callable

from specgate.decoding.sampling import SamplingParams, sample_token
from specgate.decoding.target import Target


def plain_decode(
    target: Target,
    prompt: list[int],
    n: int,
    params: SamplingParams | None = None,
    end_id: int | None = None,
    on_token: Callable[[int], None] = lambda _: None,
    slot: int = 0,
) -> list[int]:
    """Up to n tokens after `prompt` (greedy by default); stops at `end_id` (default: the model's
    EOS; not emitted). `on_token` sees each token as it is made. Leaves the slot released."""
    params = params or SamplingParams()
    end_id = target.info.eos_token_id if end_id is None else end_id
    gen = params.generator()
    logits, _ = target.prefill(slot, prompt, features=False)
    out: list[int] = []
    try:
        while len(out) < n:
            tok = sample_token(logits, params, gen)
            if tok == end_id:
                break
            out.append(tok)
            on_token(tok)
            if len(out) < n:
                logits = target.forward([(slot, [tok])])[0]
    finally:
        target.release(slot)
    return out


def greedy_decode(target: Target, prompt: list[int], n: int) -> list[int]:
    return plain_decode(target, prompt, n)
