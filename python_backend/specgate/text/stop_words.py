"""TensorRT-LLM's stop_words_list layout [2, n], both ways: concatenated ids, then end offsets padded
with -1, and the bounds every model holds stop words to. Its own module so that engines read it
without loading a tokenizer."""

from __future__ import annotations

import numpy as np

from specgate.contract import MAX_STOP_BYTES, MAX_STOP_TOKENS, MAX_STOP_WORDS
from specgate.errors import InvalidInput


def check_stop_strings(stops: list[str], field: str = "stop") -> None:
    """InvalidInput naming `field` unless there are at most MAX_STOP_WORDS of at most MAX_STOP_BYTES each."""
    if len(stops) > MAX_STOP_WORDS:
        raise InvalidInput(f"{field}: {len(stops)} stop strings; at most {MAX_STOP_WORDS} are allowed")
    for s in stops:
        if len(s.encode()) > MAX_STOP_BYTES:
            raise InvalidInput(f"{field}: a stop string of {len(s.encode())} bytes; at most {MAX_STOP_BYTES} are allowed")


def check_stop_words(words: list[list[int]], field: str = "stop_words_list") -> None:
    """The token-level bound (engines, and the gate for direct callers): InvalidInput naming `field`."""
    if len(words) > MAX_STOP_WORDS:
        raise InvalidInput(f"{field}: {len(words)} stop sequences; at most {MAX_STOP_WORDS} are allowed")
    if any(len(w) > MAX_STOP_TOKENS for w in words):
        raise InvalidInput(f"{field}: a stop sequence of {max(map(len, words))} tokens; at most {MAX_STOP_TOKENS} are allowed")


def stop_words_list(words: list[list[int]]) -> np.ndarray:
    """The layout of `words` (token sequences; empty ones are left out)."""
    flat: list[int] = []
    offsets: list[int] = []
    for ids in words:
        if ids:
            flat += ids
            offsets.append(len(flat))
    if not flat:
        return np.array([[0], [-1]], dtype=np.int32)
    offsets += [-1] * (len(flat) - len(offsets))
    return np.array([flat, offsets], dtype=np.int32)


def parse_stop_words_list(arr: np.ndarray) -> list[list[int]]:
    """Inverse of `stop_words_list`: the token sequences to stop at, within `check_stop_words`' bounds."""
    arr = np.asarray(arr).reshape(2, -1)
    flat, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    out, start = [], 0
    for end in offsets:
        out.append(flat[start:end])
        start = end
    words = [w for w in out if w]
    check_stop_words(words)
    return words
