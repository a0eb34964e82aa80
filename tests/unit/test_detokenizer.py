"""Incremental detokenization: any split of the output into responses concatenates to the full text."""

from __future__ import annotations

import random

import pytest

from specgate.text.detokenizer import WINDOW, delta_text
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


def _full_delta(tok, ids: list[int], prev: int, final: bool) -> str:  # noqa: ANN001
    """The definition: decode everything, twice."""
    stable = lambda part: tok.decode(part).rstrip("\ufffd")  # noqa: E731
    full = tok.decode(ids) if final else stable(ids)
    return full[len(stable(ids[:prev])) :] if prev else full


@pytest.mark.parametrize("source", ["text", "any_ids"])
def test_the_window_decodes_what_decoding_everything_does(tok, source):
    """delta_text decodes from a window before the new tokens; on long outputs it must give what
    decoding all of them gives, also where the window would start inside a character (byte tokens of
    CJK and emoji) and on id sequences that are not UTF-8 at all (any ids the model may emit)."""
    rng = random.Random(1)
    text = "Le cœur a ses raisons 🌊🐙 que la raison ne connaît point. 日本語のテキストと絵文字👩‍👩‍👧、한국어 문장. " * 6
    vocab = tok.tok.get_vocab_size()
    checked = 0
    for _ in range(60):
        if source == "text":
            ids = tok.encode(text)[rng.randrange(40) :]
        else:  # random ids, weighted toward the byte tokens that split characters
            ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(256) for _ in range(120)]
        for _ in range(10):
            prev = rng.randrange(len(ids))
            n = rng.randrange(prev + 1, len(ids) + 1)
            final = rng.random() < 0.2
            assert delta_text(tok, ids[:n], prev, final) == _full_delta(tok, ids[:n], prev, final), (ids[:n], prev)
            checked += 1
    assert checked == 600


@pytest.mark.parametrize("run", [WINDOW + 4, 3 * WINDOW])  # back to a boundary; past MAX_BACKTRACK: from 0
def test_a_run_of_broken_bytes_longer_than_the_window_is_not_lost(tok, run):
    """Bytes that form no character are held back while they trail (they may yet complete one); a run
    of them longer than the window must still come out whole once text follows it."""
    broken = [i for i in range(512) if tok.decode([i]).startswith("\ufffd")][:run]
    word = tok.encode(" and")
    ids = word * 4 + broken + word * 4
    if run == WINDOW + 4:  # also split by a special token (no text of its own) where the window would start
        ids = word * 4 + broken[:4] + [tok.eos_id] + broken[4:] + word * 4
    for prev in range(len(word) * 4, len(word) * 4 + len(broken) + 1):
        for n in range(prev + 1, len(ids) + 1):
            assert delta_text(tok, ids[:n], prev, False) == _full_delta(tok, ids[:n], prev, False), (prev, n)
