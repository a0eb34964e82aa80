"""One completion: a prompt sent to `llm` over gRPC streaming, answered whole or as server-sent events.

The first `llm` response is awaited before the HTTP status goes out, so a request the gate rejects
gets a 4xx with OpenAI's error body, streamed or not. A client that leaves stops the request: the
Triton stream is closed, which cancels it through the gate.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from specgate.contract import HEADER_API_KEY, HEADER_SPEC_MODE
from specgate_client import Chunk, GenerateParams, gate_headers
from specgate_front.formats import Format, finish_reason, meta_headers
from specgate_front.schemas import ErrorDetail, ErrorResponse, GenerationRequest, SpecgateMeta, Usage
from specgate_front.stops import StopTrimmer
from specgate_front.triton import BackendError

T = TypeVar("T")


@dataclass
class Completion:
    """What one request asked for, and what is needed to answer it."""

    rid: str
    model: str
    body: GenerationRequest
    params: GenerateParams
    n_prompt: int
    fmt: Format

    def usage(self, meta: dict[str, Any]) -> Usage:
        out = meta["num_output_tokens"]
        return Usage(prompt_tokens=self.n_prompt, completion_tokens=out, total_tokens=self.n_prompt + out)


async def complete(
    request: Request, body: GenerationRequest, max_tokens: int | None, prompt: str, n_prompt: int, fmt: Format, model: str
) -> Response:
    c = Completion(f"{fmt.prefix}-{uuid.uuid4().hex}", model, body, body.generate_params(max_tokens), n_prompt, fmt)
    headers = gate_headers(request.headers.get(HEADER_API_KEY), request.headers.get(HEADER_SPEC_MODE))
    chunks = request.app.state.triton.generate(prompt, c.params, headers, stream=bool(body.stream))
    return await (_stream(request, c, chunks) if body.stream else _whole(request, c, chunks))


async def _whole(request: Request, c: Completion, chunks: AsyncIterator[Chunk]) -> Response:
    got = await unless_disconnected(request, _collect(chunks))
    if got is None:
        return Response(status_code=499)  # nobody is listening
    if not got:
        raise BackendError(502, f"{c.model} sent no output")
    meta = got[-1].meta
    trim = StopTrimmer(c.body.stops())
    text = trim.push("".join(ch.text for ch in got)) + trim.finish()
    out = c.fmt.response(c.rid, c.model, text, finish_reason(meta, c.params.max_tokens), c.usage(meta), SpecgateMeta(**meta))
    return JSONResponse(out.model_dump(), headers=meta_headers(meta))


async def _stream(request: Request, c: Completion, chunks: AsyncIterator[Chunk]) -> Response:
    try:
        first = await unless_disconnected(request, anext(chunks))
    except StopAsyncIteration:
        raise BackendError(502, f"{c.model} sent no output") from None
    if first is None:
        return Response(status_code=499)
    return EventSourceResponse(_events(c, first, chunks, int(time.time())), headers=meta_headers(first.meta), sep="\n")


async def _events(c: Completion, first: Chunk, chunks: AsyncIterator[Chunk], created: int) -> AsyncIterator[str]:
    """The server-sent events of a stream whose first `llm` response is `first`."""
    fmt, trim, meta = c.fmt, StopTrimmer(c.body.stops()), first.meta
    include_usage = c.body.stream_options is not None and c.body.stream_options.include_usage
    async with aclosing(chunks):
        opening = fmt.opening(c.rid, c.model, created, SpecgateMeta(**meta))
        if opening is not None:
            yield opening.model_dump_json()
        try:
            pending: Chunk | None = first
            while pending is not None:
                meta = pending.meta
                text = trim.push(pending.text)
                if text:
                    yield fmt.delta(c.rid, c.model, created, text, None, SpecgateMeta(**meta)).model_dump_json()
                pending = await anext(chunks, None)
        except BackendError as exc:  # the status line is sent: OpenAI's in-stream error event
            kind = "server_error" if exc.status >= 500 else "invalid_request_error"
            yield ErrorResponse(error=ErrorDetail(message=exc.message, type=kind)).model_dump_json()
            return
        m = SpecgateMeta(**meta)
        yield fmt.delta(c.rid, c.model, created, trim.finish(), finish_reason(meta, c.params.max_tokens), m).model_dump_json()
        if include_usage:
            yield fmt.usage(c.rid, c.model, created, c.usage(meta), m).model_dump_json()
        yield "[DONE]"


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
        return [ch async for ch in chunks]
