"""The body shapes of the two completion endpoints (chat and text), and what both send alike: the
finish reason and the `x-specgate-*` headers that carry the gate's outputs."""

from __future__ import annotations

from typing import Any, Protocol

from specgate_client import META
from specgate_front.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    FinishReason,
    SpecgateMeta,
    Usage,
)

META_HEADER_PREFIX = "x-specgate-"


def meta_headers(meta: dict[str, Any]) -> dict[str, str]:
    """`x-specgate-route`, `x-specgate-gate-reason`, ... one header per field of `specgate_client.META`."""
    return {META_HEADER_PREFIX + k.replace("_", "-"): str(meta[k]) for k in META}


def finish_reason(meta: dict[str, Any], max_tokens: int) -> FinishReason:
    return "length" if meta["num_output_tokens"] >= max_tokens else "stop"


class Format(Protocol):
    """The body shapes of one endpoint (chat or text completions); `meta` is the latest `llm` response's."""

    prefix: str

    def response(self, rid: str, model: str, text: str, finish: FinishReason, usage: Usage, meta: SpecgateMeta) -> Any: ...
    def opening(self, rid: str, model: str, created: int, meta: SpecgateMeta) -> Any | None: ...
    def delta(self, rid: str, model: str, created: int, text: str, finish: FinishReason | None, meta: SpecgateMeta) -> Any: ...
    def usage(self, rid: str, model: str, created: int, usage: Usage, meta: SpecgateMeta) -> Any: ...


class ChatFormat:
    prefix = "chatcmpl"

    def response(self, rid: str, model: str, text: str, finish: FinishReason, usage: Usage, meta: SpecgateMeta) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)
        return ChatCompletion(id=rid, model=model, choices=[choice], usage=usage, specgate=meta)

    def opening(self, rid: str, model: str, created: int, meta: SpecgateMeta) -> ChatCompletionChunk:
        return self._chunk(rid, model, created, [ChatChunkChoice(delta=Delta(role="assistant", content=""))], meta)

    def delta(self, rid: str, model: str, created: int, text: str, finish: FinishReason | None, meta: SpecgateMeta) -> ChatCompletionChunk:
        return self._chunk(rid, model, created, [ChatChunkChoice(delta=Delta(content=text or None), finish_reason=finish)], meta)

    def usage(self, rid: str, model: str, created: int, usage: Usage, meta: SpecgateMeta) -> ChatCompletionChunk:
        return self._chunk(rid, model, created, [], meta, usage)

    @staticmethod
    def _chunk(
        rid: str, model: str, created: int, choices: list[ChatChunkChoice], meta: SpecgateMeta, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, created=created, choices=choices, usage=usage, specgate=meta)


class TextFormat:
    prefix = "cmpl"

    def response(self, rid: str, model: str, text: str, finish: FinishReason, usage: Usage, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, choices=[CompletionChoice(text=text, finish_reason=finish)], usage=usage, specgate=meta)

    def opening(self, rid: str, model: str, created: int, meta: SpecgateMeta) -> None:
        return None  # text completion streams start with the text

    def delta(self, rid: str, model: str, created: int, text: str, finish: FinishReason | None, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, created=created, choices=[CompletionChoice(text=text, finish_reason=finish)], specgate=meta)

    def usage(self, rid: str, model: str, created: int, usage: Usage, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, created=created, choices=[], usage=usage, specgate=meta)
