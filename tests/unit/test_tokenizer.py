"""The serving tokenizer (`tokenizers` and transformers' chat-template renderer, without torch) gives
exactly what transformers' AutoTokenizer gives for the same checkpoint: prompts and conversations
through the chat template, plain encodes, decodes and the end-of-sequence id."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from specgate.errors import InvalidInput
from specgate.text.tokenizer import PromptTokenizer
from tests.conftest import ROOT
from tests.prompts import GREEDY_PROMPTS, UNICODE_PROMPTS

TEXTS = [
    "Hello there",
    "  leading spaces, trailing too  ",
    "Line one\nline two\n\n\tindented",
    "Ça va? 🌊🐙 日本語のテキスト, emoji👩‍👩‍👧 family",
    "A prompt naming <|im_end|> and <|im_start|>assistant inside it",
    "{{ not a template }} {% neither %}",
    *GREEDY_PROMPTS,
    *UNICODE_PROMPTS,
]


@pytest.fixture(scope="module")
def ours(checkpoint) -> PromptTokenizer:  # noqa: ANN001
    return PromptTokenizer(checkpoint, 10**6)


@pytest.fixture(scope="module")
def reference(checkpoint):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def test_prompts_and_encodes_are_transformers(ours, reference) -> None:  # noqa: ANN001
    for text in TEXTS:
        chat = reference.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        chat = chat["input_ids"] if hasattr(chat, "keys") else chat
        assert ours.encode_prompt(text) == list(chat), text
        assert ours.encode_prompt(text, chat=False) == reference.encode(text, add_special_tokens=False), text
    assert ours.eos_id == reference.eos_token_id
    assert ours.vocab_size == len(reference)  # build_engines renders it as the gate's vocab_size


def test_conversations_render_as_transformers(ours, reference) -> None:  # noqa: ANN001
    """The OpenAI front renders whole conversations (system, user and assistant turns)."""
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": TEXTS[3]},
            {"role": "assistant", "content": "Oui."}, {"role": "user", "content": TEXTS[2]}]  # fmt: skip
    for messages in (chat, chat[1:], chat[:2]):
        assert ours.render_chat(messages) == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_decodes_are_transformers(ours, reference) -> None:  # noqa: ANN001
    rng = random.Random(0)
    specials = [ours.eos_id, *reference.all_special_ids]
    for _ in range(300):  # any ids, specials among them, cut anywhere (half a character included)
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(reference.vocab_size) for _ in range(rng.randint(1, 40))]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids


def test_the_preprocessing_and_gate_stubs_start_without_torch() -> None:
    """Why this tokenizer exists: torch (via AutoTokenizer) was most of a server's start-up CPU."""
    code = "import sys; import specgate.serving.preprocessing_model, specgate.serving.gate_model; print('torch' in sys.modules)"
    path = ":".join(str(p) for p in (ROOT / "tests" / "unit", ROOT / "python_backend", ROOT))
    fake = "import sys, fake_pb_utils; sys.modules['triton_python_backend_utils'] = fake_pb_utils"
    out = subprocess.run([sys.executable, "-c", f"{fake}; {code}"], cwd=ROOT, env={"PYTHONPATH": path}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_tokenizer_that_renders_no_chat_imports_no_transformers_and_renders_one_on_demand(checkpoint, ours) -> None:  # noqa: ANN001
    """spec_gate and a repository render only decode or read ids: they skip transformers' import
    (about 1.3 s of CPU per process), and a chat rendered after all is the same."""
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'python_backend')!r}]; from specgate.text.tokenizer import PromptTokenizer; "
            f"t = PromptTokenizer({str(checkpoint)!r}, 10**6, chat=False); print('transformers' in sys.modules, t.eos_id, t.vocab_size); "
            "print(repr(t.render_chat([{'role': 'user', 'content': 'Hello there'}])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == f"False {ours.eos_id} {ours.vocab_size}"
    assert out[1] == repr(ours.render_chat([{"role": "user", "content": "Hello there"}]))


def test_a_prompt_too_large_for_the_context_is_refused_before_it_is_tokenized(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Issue 49: a huge prompt was tokenized whole (seconds of a text stub's CPU) before its length
    was checked. Its size in bytes alone now says it cannot fit."""
    tok = PromptTokenizer(checkpoint, 2047)
    monkeypatch.setattr(tok, "encode", lambda text: pytest.fail("tokenized"))
    for chat in (True, False):
        with pytest.raises(InvalidInput, match="bytes, more than 2047 tokens can hold"):
            tok.encode_prompt("word " * 1_000_000, chat=chat)
    monkeypatch.undo()
    with pytest.raises(InvalidInput, match="tokens; the limit is 2047"):  # within the byte bound, past the token one
        tok.encode_prompt("word " * 3000)
    assert len(tok.encode_prompt("word " * 1000)) <= 2047
