"""API key check and request body size limit."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotserve.server.errors import APIError, error_body


async def require_api_key(request: Request) -> None:
    """With an API key configured, every guarded route needs it, as
    ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``."""
    check_key(request, request.app.state.server.api_key, "API key")


async def require_metrics_key(request: Request) -> None:
    """With ``--metrics-key`` set, ``/metrics`` needs that key (same headers)."""
    check_key(request, request.app.state.server.metrics_key, "metrics key")


def check_key(request: Request, expected: str | None, what: str) -> None:
    """401 unless ``expected`` is None or the request carries it (either header)."""
    if expected is None:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    offered = [request.headers.get("x-api-key")]
    if scheme.lower() == "bearer":
        offered.append(bearer)
    if not any(
        given is not None and hmac.compare_digest(given.encode(), expected.encode())
        for given in offered
    ):
        raise APIError(
            401,
            f"missing or wrong {what}: send Authorization: Bearer <key> or X-Api-Key: <key>",
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
