"""Incremental detokenization: any split of the output into responses concatenates to the full text."""

from __future__ import annotations

import random

import pytest

from specgate.text.detokenizer import delta_text
from specgate.text.tokenizer import PromptTokenizer


@pytest.fixture(scope="module")
def tok(checkpoint) -> PromptTokenizer:  # noqa: ANN001
    return PromptTokenizer(checkpoint, 1)


@pytest.mark.parametrize("text", ["Hello world, ça va? 🌊🐙 日本語のテキスト", " leading space and  double  spaces", "emoji👩‍👩‍👧 family"])
def test_stream_concat_equals_full_decode(tok, text):
    ids = tok.encode(text)
    full = tok.decode(ids)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(1, 6))))
        pieces, prev = [], 0
        for c in cuts:
            pieces.append(delta_text(tok, ids[:c], prev, final=False))
            prev = c
        pieces.append(delta_text(tok, ids, prev, final=True))
        assert "".join(pieces) == full
        assert all("\ufffd" not in p for p in pieces[:-1]), "partial characters must be held back"


def test_token_by_token(tok):
    ids = tok.encode("naïve café 🎉 done")
    out = "".join(delta_text(tok, ids[: i + 1], i, final=i == len(ids) - 1) for i in range(len(ids)))
    assert out == tok.decode(ids)
