"""TensorRT-LLM's stop_words_list layout [2, n], both ways: concatenated ids, then end offsets padded
with -1. Its own module so that engines read it without loading a tokenizer."""

from __future__ import annotations

import numpy as np


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
    """Inverse of `stop_words_list`: the token sequences to stop at."""
    arr = np.asarray(arr).reshape(2, -1)
    flat, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    out, start = [], 0
    for end in offsets:
        out.append(flat[start:end])
        start = end
    return [w for w in out if w]
