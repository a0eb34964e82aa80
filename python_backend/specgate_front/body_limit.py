"""A bound on request bodies: Starlette reads a body whole, whatever its size, before the app sees it.

The largest body the front needs is a prompt the model's context can hold, a few hundred KB at most
(PromptTokenizer.max_input_bytes) in JSON; MAX_BODY_BYTES leaves room for that. A declared
Content-Length over it is refused before anything is read, and a chunked body once it grows past it.
(No Starlette or uvicorn setting bounds a body.)
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

MAX_BODY_BYTES = 1 << 20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """413. An HTTPException, because FastAPI turns any other exception raised while it reads a body
    into a 400 ("There was an error parsing the body")."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(413, f"the request body is {size} bytes or more; at most {limit} are accepted")


class BodyLimit:
    """ASGI middleware: the body's first read raises BodyTooLarge where its declared length is past
    `max_bytes`, and a later read once the chunks read so far are. Raised at the read, inside the
    app, so that the app's own error handler answers it (errors.py)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        seen = int(declared) if declared.isdigit() else 0

        async def bounded() -> dict[str, Any]:
            nonlocal seen
            if seen > self.max_bytes:
                raise BodyTooLarge(seen, self.max_bytes)
            message = await receive()
            if message["type"] == "http.request" and not declared:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(seen, self.max_bytes)
            return message

        await self.app(scope, bounded, send)
