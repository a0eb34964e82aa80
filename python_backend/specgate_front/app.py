"""The OpenAI-compatible HTTP API: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`;
and `GET /health/ready`, the replica's readiness (Triton ready, the front answering, a calibration).

A thin client of Triton: each request becomes one `llm` call over gRPC streaming (front/triton.py);
`x-api-key` and `x-speculative-decoding` become gRPC headers, which the gate reads. Every response
carries the gate's outputs twice: in the `specgate` field of the body (every streamed chunk too) and
in `x-specgate-*` response headers. A stream's headers leave before its text, so they hold what the
first `llm` response said (route and reason as decided, counts so far); its last chunk has the final
values.

The rooms: completion.py answers one request (whole or streamed), formats.py shapes chat and text
bodies, errors.py answers every error in OpenAI's shape, triton.py talks to Triton.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specgate_front import errors
from specgate_front.body_limit import BodyLimit
from specgate_front.completion import complete
from specgate_front.formats import ChatFormat, TextFormat
from specgate_front.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Model,
    ModelList,
    Readiness,
)
from specgate_front.triton import LLM_MODEL, BackendError, Triton

log = logging.getLogger("specgate_front")

ERRORS = {400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 502: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def create_app(grpc_url: str, model: str = LLM_MODEL, http_url: str | None = None) -> FastAPI:
    """The front for the `model` ensemble of the Triton server at `grpc_url` (host:port); `http_url`,
    the same server's HTTP endpoint, is what /health/ready asks first."""
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.triton = triton = Triton(grpc_url, model, http_url)  # in the server's event loop, as its asyncio channel must be
        try:
            await triton.tokenizer()  # load it now, not on the first request, if Triton is up
        except BackendError as exc:
            log.warning("tokenizer not loaded yet: %s", exc)
        yield
        await triton.close()

    app = FastAPI(title="specgate OpenAI-compatible front", lifespan=lifespan)
    app.add_middleware(BodyLimit)
    errors.install(app, model)

    def check_model(name: str) -> None:
        if name != model:
            raise errors.ModelNotFound(name)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[Model(id=model, created=started)])

    @app.get("/health/ready", response_model=Readiness, responses={503: {"model": Readiness}})
    async def ready(request: Request) -> Response:
        reason = await request.app.state.triton.not_ready()
        return Response(Readiness(ready=reason is None, reason=reason).model_dump_json(), status_code=200 if reason is None else 503,
                        media_type="application/json")

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt, n_prompt = await request.app.state.triton.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        return await complete(request, body, body.output_limit(), prompt, n_prompt, ChatFormat(), model)

    @app.post("/v1/completions", response_model=Completion, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt = body.text()
        return await complete(request, body, body.output_limit(), prompt, await request.app.state.triton.count_tokens(prompt),
                              TextFormat(), model)

    return app
