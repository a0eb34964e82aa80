"""Incremental detokenization: the new text of a response, from the ids so far and how many are text already.

Byte-level BPE can split one character (emoji, CJK) across tokens, so a token's text is not known
until the following tokens arrive. spec_gate keeps each request's output ids and how many of them
earlier responses already turned into text; the new text is the difference of the two *stable*
decodes (a trailing U+FFFD from an incomplete character is held back until it completes).

Both decodes start a few tokens before the text already sent, not at the first token, so that a
response costs the same at token 2000 as at token 20 (decoding everything each time made a long
reply's detokenization quadratic). The window starts on a character boundary and at least one token
before the new ones: decoders that drop a leading space from the first token they decode
(SentencePiece's) then drop it from both decodes alike.
"""

from __future__ import annotations

from typing import Protocol

_INCOMPLETE = "\ufffd"
WINDOW = 8  # tokens decoded before the new ones: more than any one character spans
MAX_BACKTRACK = 8  # further tokens to step back to reach a character boundary; else decode from 0


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def stable_text(tok: Decoder, ids: list[int]) -> str:
    return tok.decode(ids).rstrip(_INCOMPLETE)


def window_start(tok: Decoder, ids: list[int], prev_len: int) -> int:
    """Where decoding may start: at least WINDOW tokens before `prev_len`, at a token that has text of
    its own (not a special token) beginning with a whole character; 0 if none is found close by
    (decode everything: always right). Such a first token keeps bytes still held back before the
    window from being taken for the window's own."""
    start = prev_len - WINDOW
    for _ in range(MAX_BACKTRACK):
        if start <= 0:
            return 0
        first = tok.decode(ids[start : start + 1])
        if first and not first.startswith(_INCOMPLETE):
            return start
        start -= 1
    return 0


def delta_text(tok: Decoder, ids: list[int], prev_len: int, final: bool) -> str:
    """Text that `ids` adds over `ids[:prev_len]`; on the final response, flush everything."""
    start = window_start(tok, ids, prev_len)  # 0 while prev_len <= WINDOW
    window = ids[start:]
    full = tok.decode(window) if final else stable_text(tok, window)
    return full[len(stable_text(tok, window[: prev_len - start])) :] if prev_len else full
