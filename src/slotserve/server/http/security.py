"""API key checks, made from the request head before any byte of the body is read, and the
request body size limit."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slotserve.server.http.errors import APIError


async def require_api_key(request: Request) -> None:
    """With an API key configured, every guarded route needs it, as
    ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``."""
    check_key(request, request.app.state.server.api_key, "API key")


async def require_metrics_key(request: Request) -> None:
    """With ``--metrics-key`` set, ``/metrics`` needs that key (same headers)."""
    check_key(request, request.app.state.server.metrics_key, "metrics key")


def check_key(request: Request, expected: str | None, what: str) -> None:
    """401 unless ``expected`` is None or the request carries it (either header)."""
    if not carries_key(request.headers, expected):
        raise key_error(what, request.headers)


def carries_key(headers: Mapping[str, str], expected: str | None) -> bool:
    """Whether a request head carries ``expected`` (True when it is None), as
    ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``."""
    if expected is None:
        return True
    scheme, _, bearer = headers.get("authorization", "").partition(" ")
    offered = [headers.get("x-api-key")]
    if scheme.lower() == "bearer":
        offered.append(bearer)
    return any(
        given is not None and hmac.compare_digest(given.encode(), expected.encode())
        for given in offered
    )


def key_error(what: str, headers: Mapping[str, str]) -> APIError:
    """The 401. It closes the connection when the request announced a body, which is then
    never read (the client would otherwise have to send it all before its next request)."""
    announced = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    return APIError(
        401,
        f"missing or wrong {what}: send Authorization: Bearer <key> or X-Api-Key: <key>",
        "invalid_request_error",
        code="invalid_api_key",
        headers={"Connection": "close"} if announced else None,
    )


# The key dependencies a route may declare → (the ServerState field holding it, its name).
KEY_DEPENDENCIES: dict[Callable[..., Any], tuple[str, str]] = {
    require_api_key: ("api_key", "API key"),
    require_metrics_key: ("metrics_key", "metrics key"),
}


class KeyedRoute(APIRoute):
    """A route that checks the keys its dependencies require (`KEY_DEPENDENCIES`) from the
    request head, before its handler reads any byte of the body: a client without the key
    gets 401 at once whatever its body (invalid JSON, one over the limit, one still on its
    way), and holds no connection for the body's sake. FastAPI reads a body before it
    solves dependencies, so the dependencies alone would check only after the whole body.
    They stay on the route all the same (what the route needs is declared there, once).

    Every router with a key dependency takes it: ``APIRouter(route_class=KeyedRoute)``. The
    401 is OpenAI's error shape; a route of another API answers it in its own (`refuse`)."""

    def refuse(self, error: APIError) -> Response:
        """The answer to a request refused from its head (the app's error handler's)."""
        raise error

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        declared = {getattr(depends, "dependency", None) for depends in self.dependencies}
        needed = [key for call, key in KEY_DEPENDENCIES.items() if call in declared]
        if not needed:
            return handler

        async def keyed(request: Request) -> Response:
            state = request.app.state.server
            for attribute, what in needed:
                if not carries_key(request.headers, getattr(state, attribute)):
                    return self.refuse(key_error(what, request.headers))
            return await handler(request)

        return keyed


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413, declared (``Content-Length``)
    or streamed (chunked). Both are refused when the app first reads the body, so a route's
    key check from the head (`KeyedRoute`) answers first; a declared size over the limit is
    refused before a byte of the body is read, and the connection is closed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.limit
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            if too_large:  # FastAPI passes an HTTPException from the body read on
                raise HTTPException(413, self._message(declared), {"Connection": "close"})
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # a streamed (chunked) body
                raise HTTPException(413, self._message(None), {"Connection": "close"})
            return message

        await self.app(scope, limited, send)

    def _message(self, declared: bytes | None) -> str:
        size = f" of {int(declared)} bytes" if declared is not None else ""
        return (
            f"request body{size} over the server's limit of {self.limit} bytes "
            "(--max-body-bytes): send less, or start the server with a higher --max-body-bytes"
        )
