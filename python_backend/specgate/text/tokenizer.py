"""Prompt preparation: chat template, tokenization, stop strings as token ids.

Served through the `tokenizers` library and transformers' own chat-template renderer, not
`AutoTokenizer`: importing the latter pulls in torch, and three text stubs doing so were most of a
server's start-up CPU. tests/unit/test_tokenizer.py holds this to AutoTokenizer's output.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tokenizers import Tokenizer

from specgate.errors import InvalidInput
from specgate.text.stop_words import stop_words_list

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what a chat template may name


class PromptTokenizer:
    """The checkpoint directory's tokenizer (`tokenizer.json`, `tokenizer_config.json` and the chat
    template, as `save_pretrained` writes them)."""

    def __init__(self, checkpoint_dir: str | Path, max_input_len: int, chat: bool = True) -> None:
        """`chat`: load the chat-template renderer now, not at the first `render_chat` (False where
        no chat is ever rendered: postprocessing, a repository render)."""
        if chat:
            _chat_renderer()
        root = Path(checkpoint_dir)
        self.tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config = json.loads((root / "tokenizer_config.json").read_text())
        template = root / "chat_template.jinja"  # where our pinned transformers writes it; older ones put it in the config
        self.chat_template: str | None = template.read_text() if template.exists() else config.get("chat_template")
        # a special token is a string, or {"content": ...} in older configs
        self.special = {k: v["content"] if isinstance(v, dict) else v for k in SPECIAL_TOKENS if (v := config.get(k))}
        self.max_input_len = max_input_len
        # No token covers more bytes of text than its own string has in UTF-8 (a byte-level token's
        # string has a character per byte; SentencePiece's "<0x0A>" and "▁" have more): so a prompt of
        # more bytes than this cannot fit in max_input_len tokens, and is refused before it is tokenized.
        self.max_input_bytes = max_input_len * max(len(t.encode()) for t in self.tok.get_vocab(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        eos = self.tok.token_to_id(self.special.get("eos_token", ""))
        if eos is None:
            raise ValueError("the tokenizer's config names no eos_token in its vocabulary")
        return eos

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce, added tokens included (transformers' `len(tokenizer)`)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def decode_utf8(raw: bytes, field: str = "text_input") -> str:
        """`raw` as text; InvalidInput naming `field` (the input it came from) if it is not UTF-8."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{field} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, no special tokens added (special tokens written in it still count)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens and without clean-up of spaces: exactly what was generated."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template over `messages`, ending with the assistant's turn to speak."""
        if self.chat_template is None:
            raise InvalidInput("this model has no chat template: send apply_chat_template=false")
        rendered, _ = _chat_renderer()(conversations=[messages], chat_template=self.chat_template, add_generation_prompt=True,
                                       **self.special)
        return rendered[0]

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for `text`, wrapped as one user turn of the chat template unless `chat` is False."""
        if not text.strip():
            raise InvalidInput("text_input is empty")
        self._check_bytes(text)  # before the template copies it
        return self.encode_within_limit(self.render_chat([{"role": "user", "content": text}]) if chat else text)

    def encode_within_limit(self, prompt: str) -> list[int]:
        """`prompt` (rendered already) as token ids; InvalidInput if they are more than max_input_len,
        and before tokenizing if its size alone says so: a huge prompt cost the tokenizer its whole size."""
        self._check_bytes(prompt)
        ids = self.encode(prompt)
        if len(ids) > self.max_input_len:
            raise InvalidInput(f"prompt is {len(ids)} tokens; the limit is {self.max_input_len} (context minus one output token)")
        return ids

    def _check_bytes(self, text: str) -> None:
        size = len(text.encode())
        if size > self.max_input_bytes:
            raise InvalidInput(f"prompt is {size} bytes, more than {self.max_input_len} tokens can hold; "
                               f"the limit is {self.max_input_len} tokens")

    def stop_words_list(self, stops: list[str]) -> np.ndarray:
        """`stops` in TensorRT-LLM's stop_words_list layout."""
        return stop_words_list([self.encode(s) for s in stops if s])


@functools.cache
def _chat_renderer() -> Callable[..., Any]:
    """transformers' own chat-template renderer, imported when first wanted: importing transformers
    costs about 1.3 s of CPU (2-core EPYC), paid by every server start's three text stubs and its
    repository render, of which only preprocessing renders chats."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template
