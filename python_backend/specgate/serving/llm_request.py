"""The `llm` entry point's per-request knobs, validated once in `spec_gate`.

Errors name the client-facing input (`max_tokens`, not the engine's `request_output_len`) so a user
can fix the request from the message alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE, SAMPLING_EPS, SPEC_ALGORITHMS
from specgate.errors import InvalidInput


class LLMRequest(BaseModel):
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stream: bool = False
    use_speculative_decoding: bool | None = None
    speculative_algorithm: str | None = None
    num_speculative_tokens: int | None = Field(None)
    # filled from request parameters (headers over gRPC, body fields over HTTP generate)
    api_key: str | None = None
    spec_header: str | None = None
    request_id: str = ""
    canary_key: str = ""  # a digest of the request's content (content_digest, below)
    prompt_tokens: int = 0  # the prompt's length, which the gate keys a tenant's gain by

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not 0.0 <= v < math.inf:  # also rejects NaN, and the inf a float32 overflows to
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v}")
        # greedy below the epsilon, so the router, the shadow comparison and the engines all see 0
        return 0.0 if v < SAMPLING_EPS else v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {v}")
        return v

    @field_validator("speculative_algorithm")
    @classmethod
    def _algorithm(cls, v: str | None) -> str | None:
        if v is not None and v not in SPEC_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPEC_ALGORITHMS)}; got {v!r}")
        return v


def content_digest(prompt: list[int], fields: dict[str, Any]) -> str:
    """SHA-256 of the prompt's tokens and the request's knobs and headers: the canary's key for a
    request without an id, so that every replica (and a retry on another one) decides it alike."""
    knobs = {k: v for k, v in fields.items() if k not in ("request_id", "canary_key") and v is not None}
    text = json.dumps({"prompt": prompt, "knobs": knobs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# the names a client knows these fields by (request parameters: gRPC headers, HTTP body fields)
_CLIENT_NAMES = {"api_key": HEADER_API_KEY, "spec_header": HEADER_SPEC_MODE}


def parse_llm_request(fields: dict, max_output_len: int) -> LLMRequest:
    """Validate raw fields into an LLMRequest, raising InvalidInput with a readable message that
    names each offending input."""
    mt = fields.get("max_tokens")
    if mt is not None and not 1 <= int(mt) <= max_output_len:
        raise InvalidInput(f"max_tokens must be between 1 and {max_output_len}, got {int(mt)}")
    try:
        return LLMRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise InvalidInput("; ".join(_message(e) for e in exc.errors())) from None


def _message(error: dict) -> str:
    msg = error["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in error["loc"])
    field = _CLIENT_NAMES.get(field, field)
    return msg if not field or msg.startswith(field) else f"{field}: {msg}"
