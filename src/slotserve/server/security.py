"""API key check and request body size limit."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotserve.server.errors import APIError, error_body


async def require_api_key(request: Request) -> None:
    """With an API key configured, every /v1 route needs ``Authorization: Bearer KEY``."""
    expected = request.app.state.server.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(
            401,
            "missing or wrong API key: send Authorization: Bearer <key>",
            "invalid_request_error",
            code="invalid_api_key",
        )


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 (declared or streamed)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # a streamed (chunked) body: FastAPI passes HTTPException on
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body over the limit of {self.limit} bytes"

    async def _too_large(self, send: Send) -> None:
        from fastapi.responses import JSONResponse

        response = JSONResponse(error_body(self._message(), "invalid_request_error"), 413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
