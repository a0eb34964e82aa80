"""What spec_gate reads of one `llm` request: the client's knobs and headers, the prompt, the stops.

The knobs are the contract's `llm` inputs that reach spec_gate (contract.LLM_INPUTS, step
"spec_gate"), validated once here into an LLMRequest; nothing downstream re-checks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE, LLM_INPUTS
from specgate.errors import InvalidInput
from specgate.serving.llm_request import LLMRequest, content_digest, parse_llm_request
from specgate.serving.triton_io import optional_array, optional_scalar
from specgate.text.stop_words import parse_stop_words_list

GATE_KNOBS = tuple(t for t in LLM_INPUTS if t.step == "spec_gate")


def parse_gate_request(request: Any, params: dict[str, Any], max_output_len: int, prompt: list[int]) -> LLMRequest:
    """The request's knobs and headers (request parameters), validated; InvalidInput names the field.
    `prompt`: its token ids, checked first (`prompt_ids`): the canary's digest reads every one."""
    fields = {t.name: optional_scalar(request, t.name) for t in GATE_KNOBS}
    fields = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in fields.items()}
    fields["api_key"] = params.get(HEADER_API_KEY)
    header = params.get(HEADER_SPEC_MODE)
    fields["spec_header"] = None if header is None else str(header)
    fields["request_id"] = request.request_id() or ""
    fields["canary_key"] = content_digest(prompt, fields)
    fields["prompt_tokens"] = len(prompt)
    return parse_llm_request(fields, max_output_len)


def prompt_ids(request: Any, vocab_size: int | None, max_input_len: int) -> list[int]:
    """The prompt's token ids, checked as the engines would check them, so that a bad prompt (from a
    direct caller of spec_gate; preprocessing makes good ones) is the client's error here and never
    an engine's refusal. InvalidInput names `input_ids` (or `input_lengths`). `vocab_size` None: the
    engines' vocabulary is not known here (tensorrtllm), only negative ids are refused."""
    arr = optional_array(request, "input_ids")
    if arr is None or arr.size == 0:
        raise InvalidInput("input_ids is empty: the prompt needs at least one token")
    ids = arr.reshape(-1)
    if ids.size > max_input_len:
        raise InvalidInput(f"input_ids holds {ids.size} tokens; at most {max_input_len} fit the context")
    lengths = optional_array(request, "input_lengths")
    if lengths is not None and (lengths.size != 1 or int(lengths.reshape(-1)[0]) != ids.size):
        raise InvalidInput(f"input_lengths must be [{ids.size}], the number of input_ids, got {lengths.reshape(-1).tolist()[:4]}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidInput(f"input_ids: token id {bad} is not in the model's vocabulary ({limit})")
    return [int(t) for t in ids]


def stop_words(request: Any) -> np.ndarray | None:
    """preprocessing's [2, n] stop_words_list, or None when it holds no stop sequence; InvalidInput
    past the bounds every model holds stop words to (a direct caller's: preprocessing keeps to them)."""
    arr = optional_array(request, "stop_words_list")
    if arr is None or arr.size < 2 or arr.size % 2:
        return None
    arr = arr.reshape(2, -1)
    if not (arr[1] >= 0).any():
        return None
    parse_stop_words_list(arr)
    return arr
