"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status that
tells a client whether to retry (400 for the request's fault, 502 where this replica cannot serve it now
(Triton unreachable, an engine not answering: a balancer retries it on another replica), 503 with
Retry-After for overload, 500 for ours)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specgate.errors import InvalidInput
from specgate_front.schemas import ErrorDetail, ErrorResponse
from specgate_front.triton import BackendError

log = logging.getLogger("specgate_front")


class ModelNotFound(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


def install(app: FastAPI, model: str) -> None:
    """Every error the front can meet, answered in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(InvalidInput)
    async def _invalid_input(_: Request, exc: InvalidInput) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(BackendError)
    async def _backend(_: Request, exc: BackendError) -> JSONResponse:
        response = error_response(exc.status, exc.message, code="service_unavailable" if exc.status in (502, 503) else None)
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(ModelNotFound)
    async def _no_model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(404, f"The model '{exc.name}' does not exist; this server serves '{model}'", "model", "model_not_found")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(500, f"internal error: {exc}")
