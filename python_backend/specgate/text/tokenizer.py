"""Prompt preparation: chat template, tokenization, stop strings -> TensorRT-LLM stop_words_list."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specgate.errors import InvalidInput


class PromptTokenizer:
    def __init__(self, checkpoint_dir: str | Path, max_input_len: int) -> None:
        self.tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(checkpoint_dir))
        self.max_input_len = max_input_len

    @property
    def eos_id(self) -> int:
        return int(self.tok.eos_token_id)

    @staticmethod
    def decode_utf8(raw: bytes, field: str = "text_input") -> str:
        """`raw` as text; InvalidInput naming `field` (the input it came from) if it is not UTF-8."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{field} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for `text`, wrapped as one user turn of the chat template unless `chat` is False."""
        if not text.strip():
            raise InvalidInput("text_input is empty")
        if chat:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tok.encode(text, add_special_tokens=False)
        ids = [int(i) for i in ids]
        if len(ids) > self.max_input_len:
            raise InvalidInput(f"prompt is {len(ids)} tokens; the limit is {self.max_input_len} (context minus one output token)")
        return ids

    def stop_words_list(self, stops: list[str]) -> np.ndarray:
        """TensorRT-LLM's stop_words_list layout [2, n]: concatenated ids, then end offsets padded with -1."""
        flat: list[int] = []
        offsets: list[int] = []
        for s in stops:
            if not s:
                continue
            ids = self.tok.encode(s, add_special_tokens=False)
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
