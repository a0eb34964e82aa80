"""Plain greedy decoding on a target, one token per forward: the reference speculation must equal."""

from __future__ import annotations

from specgate.engine.target import Target


def greedy_decode(target: Target, prompt: list[int], n: int, slot: int = 0) -> list[int]:
    """Up to n tokens after `prompt`; stops at EOS (not emitted). Leaves the slot released."""
    logits, _ = target.prefill(slot, prompt, features=False)
    out: list[int] = []
    try:
        while len(out) < n:
            tok = int(logits.argmax())
            if tok == target.info.eos_token_id:
                break
            out.append(tok)
            if len(out) < n:
                logits = target.forward([(slot, [tok])])[0]
    finally:
        target.release(slot)
    return out
