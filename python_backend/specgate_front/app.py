"""The OpenAI-compatible HTTP API: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

A thin client of Triton: each request becomes one `llm` call over gRPC streaming (front/triton.py);
`x-api-key` and `x-speculative-decoding` become gRPC headers, which the gate reads. Every response
carries the gate's outputs twice: in the `specgate` field of the body (every streamed chunk too) and
in `x-specgate-*` response headers. A stream's headers leave before its text, so they hold what the
first `llm` response said (route and reason as decided, counts so far); its last chunk has the final
values. The first response is awaited before the HTTP status is sent, so a request the gate rejects
gets a 4xx with OpenAI's error body, streamed or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from specgate_client import META, Chunk, gate_headers
from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE
from specgate_front.schemas import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
    CompletionChoice, CompletionRequest, Delta, ErrorDetail, ErrorResponse, FinishReason, Model, ModelList, SpecgateMeta, Usage,
    GenerationRequest,
)
from specgate_front.stops import StopTrimmer
from specgate_front.triton import LLM_MODEL, BackendError, Triton

log = logging.getLogger("specgate_front")

META_HEADER_PREFIX = "x-specgate-"
T = TypeVar("T")


def meta_headers(meta: dict[str, Any]) -> dict[str, str]:
    """`x-specgate-route`, `x-specgate-gate-reason`, ... one header per field of `specgate_client.META`."""
    return {META_HEADER_PREFIX + k.replace("_", "-"): str(meta[k]) for k in META}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem, said the way OpenAI says it, and the parameter it concerns."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err["type"] == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    if err["type"] == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    if not loc and err["type"] == "model_attributes_type":
        return "the request body must be a JSON object (Content-Type: application/json)", None
    msg = err["msg"].removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def finish_reason(meta: dict[str, Any], max_tokens: int) -> FinishReason:
    return "length" if meta["num_output_tokens"] >= max_tokens else "stop"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client has gone, with `work` cancelled (and with it the Triton
    stream). Written here because Starlette keeps a handler running after its client disconnects;
    a streaming body is watched by sse-starlette instead."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    async with aclosing(chunks):
        return [c async for c in chunks]


class _Format(Protocol):
    """The body shapes of one endpoint (chat or text completions); `meta` is the latest `llm` response's."""

    prefix: str

    def response(self, rid: str, model: str, text: str, finish: FinishReason, usage: Usage, meta: SpecgateMeta) -> Any: ...
    def opening(self, rid: str, model: str, created: int, meta: SpecgateMeta) -> Any | None: ...
    def delta(self, rid: str, model: str, created: int, text: str, finish: FinishReason | None, meta: SpecgateMeta) -> Any: ...
    def usage(self, rid: str, model: str, created: int, usage: Usage, meta: SpecgateMeta) -> Any: ...


class _ChatFormat:
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
    def _chunk(rid: str, model: str, created: int, choices: list[ChatChunkChoice], meta: SpecgateMeta, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, created=created, choices=choices, usage=usage, specgate=meta)


class _TextFormat:
    prefix = "cmpl"

    def response(self, rid: str, model: str, text: str, finish: FinishReason, usage: Usage, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, choices=[CompletionChoice(text=text, finish_reason=finish)], usage=usage, specgate=meta)

    def opening(self, rid: str, model: str, created: int, meta: SpecgateMeta) -> None:
        return None  # text completion streams start with the text

    def delta(self, rid: str, model: str, created: int, text: str, finish: FinishReason | None, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, created=created, choices=[CompletionChoice(text=text, finish_reason=finish)], specgate=meta)

    def usage(self, rid: str, model: str, created: int, usage: Usage, meta: SpecgateMeta) -> Completion:
        return Completion(id=rid, model=model, created=created, choices=[], usage=usage, specgate=meta)


def create_app(grpc_url: str, model: str = LLM_MODEL) -> FastAPI:
    """The front for the `model` ensemble of the Triton server at `grpc_url` (host:port)."""
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.triton = triton = Triton(grpc_url, model)  # in the server's event loop, as its asyncio channel must be
        try:
            await triton.tokenizer()  # load it now, not on the first request, if Triton is up
        except BackendError as exc:
            log.warning("tokenizer not loaded yet: %s", exc)
        yield
        await triton.close()

    app = FastAPI(title="specgate OpenAI-compatible front", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(BackendError)
    async def _backend(_: Request, exc: BackendError) -> JSONResponse:
        response = error_response(exc.status, exc.message, code="service_unavailable" if exc.status == 503 else None)
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(500, f"internal error: {exc}")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[Model(id=model, created=started)])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        prompt, n_prompt = await request.app.state.triton.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        return await serve(request, body, body.output_limit(), prompt, n_prompt, _ChatFormat())

    @app.post("/v1/completions", response_model=Completion, responses={400: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        prompt = body.text()
        return await serve(request, body, body.output_limit(), prompt, await request.app.state.triton.count_tokens(prompt), _TextFormat())

    def _check_model(name: str) -> None:
        if name != model:
            raise _ModelNotFound(name)

    @app.exception_handler(_ModelNotFound)
    async def _no_model(_: Request, exc: _ModelNotFound) -> JSONResponse:
        return error_response(404, f"The model '{exc.name}' does not exist; this server serves '{model}'", "model", "model_not_found")

    async def serve(request: Request, body: GenerationRequest, max_tokens: int | None, prompt: str, n_prompt: int, fmt: _Format) -> Response:
        params = body.generate_params(max_tokens)
        headers = gate_headers(request.headers.get(HEADER_API_KEY), request.headers.get(HEADER_SPEC_MODE))
        rid = f"{fmt.prefix}-{uuid.uuid4().hex}"
        chunks = request.app.state.triton.generate(prompt, params, headers, stream=bool(body.stream))

        def usage(meta: dict[str, Any]) -> Usage:
            return Usage(prompt_tokens=n_prompt, completion_tokens=meta["num_output_tokens"], total_tokens=n_prompt + meta["num_output_tokens"])

        trim = StopTrimmer(body.stops())
        if not body.stream:
            got = await unless_disconnected(request, _collect(chunks))
            if got is None:
                return Response(status_code=499)  # nobody is listening
            if not got:
                raise BackendError(502, f"{model} sent no output")
            meta = got[-1].meta
            text = trim.push("".join(c.text for c in got)) + trim.finish()
            out = fmt.response(rid, model, text, finish_reason(meta, params.max_tokens), usage(meta), SpecgateMeta(**meta))
            return JSONResponse(out.model_dump(), headers=meta_headers(meta))

        try:
            first = await unless_disconnected(request, anext(chunks))
        except StopAsyncIteration:
            raise BackendError(502, f"{model} sent no output") from None
        if first is None:
            return Response(status_code=499)
        created = int(time.time())
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            meta = first.meta
            async with aclosing(chunks):
                opening = fmt.opening(rid, model, created, SpecgateMeta(**meta))
                if opening is not None:
                    yield opening.model_dump_json()
                try:
                    pending: Chunk | None = first
                    while pending is not None:
                        meta = pending.meta
                        text = trim.push(pending.text)
                        if text:
                            yield fmt.delta(rid, model, created, text, None, SpecgateMeta(**meta)).model_dump_json()
                        pending = await anext(chunks, None)
                except BackendError as exc:  # the status line is sent: OpenAI's in-stream error event
                    kind = "server_error" if exc.status >= 500 else "invalid_request_error"
                    yield ErrorResponse(error=ErrorDetail(message=exc.message, type=kind)).model_dump_json()
                    return
                m = SpecgateMeta(**meta)
                yield fmt.delta(rid, model, created, trim.finish(), finish_reason(meta, params.max_tokens), m).model_dump_json()
                if include_usage:
                    yield fmt.usage(rid, model, created, usage(meta), m).model_dump_json()
                yield "[DONE]"

        return EventSourceResponse(events(), headers=meta_headers(first.meta), sep="\n")

    return app


class _ModelNotFound(Exception):
    def __init__(self, name: str) -> None:
        self.name = name
