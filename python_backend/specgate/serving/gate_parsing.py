"""What spec_gate reads of one `llm` request: the client's knobs and headers, the prompt, the stops.

The knobs are the contract's `llm` inputs that reach spec_gate (contract.LLM_INPUTS, step
"spec_gate"), validated once here into an LLMRequest; nothing downstream re-checks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE, LLM_INPUTS
from specgate.serving.llm_request import LLMRequest, content_digest, parse_llm_request
from specgate.serving.triton_io import optional_array, optional_scalar

GATE_KNOBS = tuple(t for t in LLM_INPUTS if t.step == "spec_gate")


def parse_gate_request(request: Any, params: dict[str, Any], max_output_len: int) -> LLMRequest:
    """The request's knobs and headers (request parameters), validated; InvalidInput names the field."""
    fields = {t.name: optional_scalar(request, t.name) for t in GATE_KNOBS}
    fields = {k: v.decode(errors="replace") if isinstance(v, bytes) else v for k, v in fields.items()}
    fields["api_key"] = params.get(HEADER_API_KEY)
    header = params.get(HEADER_SPEC_MODE)
    fields["spec_header"] = None if header is None else str(header)
    fields["request_id"] = request.request_id() or ""
    ids = optional_array(request, "input_ids")
    fields["canary_key"] = content_digest([] if ids is None else [int(t) for t in ids.reshape(-1)], fields)
    return parse_llm_request(fields, max_output_len)


def prompt_ids(request: Any) -> list[int]:
    return [int(t) for t in optional_array(request, "input_ids").reshape(-1)]


def stop_words(request: Any) -> np.ndarray | None:
    """preprocessing's [2, n] stop_words_list, or None when it holds no stop sequence."""
    arr = optional_array(request, "stop_words_list")
    if arr is None or arr.size < 2 or arr.size % 2:
        return None
    arr = arr.reshape(2, -1)
    return arr if (arr[1] >= 0).any() else None
