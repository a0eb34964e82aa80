"""Incremental detokenization, stateless per response.

Byte-level BPE can split one character (emoji, CJK) across tokens, so a token's text is not known
until the following tokens arrive. Rather than keep per-request state in the postprocessing model,
each response carries all output ids so far plus how many of them earlier responses had already
turned into text; the new text is the difference of the two *stable* decodes (a trailing U+FFFD
from an incomplete character is held back until it completes).
"""

from __future__ import annotations

from typing import Protocol

_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def stable_text(tok: Decoder, ids: list[int]) -> str:
    return tok.decode(ids).rstrip(_INCOMPLETE)


def delta_text(tok: Decoder, ids: list[int], prev_len: int, final: bool) -> str:
    """Text that `ids` adds over `ids[:prev_len]`; on the final response, flush everything."""
    full = tok.decode(ids) if final else stable_text(tok, ids)
    return full[len(stable_text(tok, ids[:prev_len])) :] if prev_len else full
