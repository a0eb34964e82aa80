"""The OpenAI request and response bodies the front speaks, as pydantic models.

Requests are strict: a parameter the front does not support is a 400 that names it (a silently
ignored `logprobs` or `n=3` would hand the client something it did not ask for), and JSON types are
not coerced (`"max_tokens": "8"` is an error, as it is for OpenAI). Responses follow OpenAI's
shapes, plus the `specgate` extension field that carries the gate's per-request outputs.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from specgate.contract import GateDecision
from specgate.text.stop_words import check_stop_strings
from specgate_client import GenerateParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# What the `llm` inputs' types hold (INT32 counts, an INT64 seed): beyond, numpy 1.x wrapped a value
# silently (max_tokens 2**32 + 1 became 1) and numpy 2 raised, a 500. The gate checks the rest.
Count = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class GenerationRequest(_Strict):
    """What chat and text completions share: sampling, stop strings, the speculative knobs."""

    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Literal[1] | None = None  # one choice per request
    # speculative knobs (the `llm` model's inputs of the same names)
    use_speculative_decoding: StrictBool | None = None
    num_speculative_tokens: Count | None = None
    speculative_algorithm: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """A literal `extra_body` object (raw HTTP) means what the openai client makes of it: its fields
        at the top level. A field given in both places is ambiguous and rejected."""
        if not isinstance(data, dict) or "extra_body" not in data:
            return data
        data = dict(data)
        extra = data.pop("extra_body")
        if extra is None:
            return data
        if not isinstance(extra, dict):
            raise ValueError("extra_body must be an object")
        both = sorted(set(extra) & set(data))
        if both:
            raise ValueError(f"{', '.join(both)} given both at the top level and in extra_body")
        return {**data, **extra}

    @model_validator(mode="after")
    def _bounded_stops(self) -> GenerationRequest:
        check_stop_strings(self.stops())  # the bounds the models hold stop strings to, said here as a 400
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def generate_params(self, max_tokens: int | None) -> GenerateParams:
        """The `llm` request. Omitted sampling fields keep the `llm` model's defaults (greedy, 128 tokens).
        The front sends the prompt already formatted, so Triton applies no chat template."""
        p = GenerateParams(
            apply_chat_template=False,
            seed=self.seed,
            stop=self.stops() or None,
            use_speculative_decoding=self.use_speculative_decoding,
            speculative_algorithm=self.speculative_algorithm,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        if max_tokens is not None:
            p.max_tokens = max_tokens
        if self.temperature is not None:
            p.temperature = self.temperature
        if self.top_p is not None:
            p.top_p = self.top_p
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None  # the newer name of max_tokens

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    # one prompt per request; a one-element list is what batching clients send for a single prompt
    prompt: StrictStr | list[StrictStr]

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a string, or a list of one string)")
        return self

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def output_limit(self) -> int | None:
        return self.max_tokens


# -- responses ----------------------------------------------------------------------------------
class SpecgateMeta(GateDecision):
    """The gate's per-request outputs (specgate_client.META), as the latest `llm` response had them."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    specgate: SpecgateMeta | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None  # a stream's chunks carry none, except the last with include_usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specgate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Readiness(BaseModel):
    """GET /health/ready: may this replica take traffic (the pod's readiness probe)."""

    ready: bool
    reason: str | None = None  # why not
