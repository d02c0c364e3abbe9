"""OpenAI-shaped errors: every failure is ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.errors import AdmissionRefused
from slotserve.server.http.validation import describe

log = logging.getLogger("slotserve")

RETRY_AFTER_S = 1
# OpenAI's code for a prompt (plus its token budget) that does not fit the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_REFUSAL_STATUS = {
    "slots_full": 429,
    "kv_exhausted": 429,
    "queue_full": 429,
    "queue_timeout": 429,
    "pressure": 429,
    "model_capacity": 429,  # an on-demand model's load has no room now: retry
    "context_too_long": 400,
    "closed": 503,
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def refusal_error(refusal: AdmissionRefused, prompt_param: str | None = None) -> APIError:
    """The HTTP answer to an engine refusal. A prompt too long for the context gets OpenAI's
    ``context_length_exceeded`` with ``param`` = ``prompt_param`` ("prompt" or "messages");
    other refusals keep the engine's reason as their code."""
    status = _REFUSAL_STATUS[refusal.reason]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    if refusal.reason == "context_too_long":
        return APIError(status, str(refusal), kind, prompt_param, CONTEXT_LENGTH_EXCEEDED)
    return APIError(status, str(refusal), kind, code=refusal.reason, headers=headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(
        error_body(exc.message, exc.kind, exc.param, exc.code), exc.status, headers=exc.headers
    )


async def validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        # Its location is a character offset, not a field: say so in the message instead.
        where = [p for p in first.get("loc", ()) if p != "body"]
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        at = f" at character {where[0]}" if where else ""
        message = f"the request body is not valid JSON: {reason}{at}"
        return JSONResponse(error_body(message, "invalid_request_error"), 400)
    if first.get("type") == "unsupported_parameter":  # schemas.refuse_unsupported
        param = first["ctx"]["param"]
        return JSONResponse(
            error_body(first["msg"], "invalid_request_error", param, "unsupported_parameter"), 400
        )
    failure = describe(exc.errors())
    body = error_body(failure.message, "invalid_request_error", failure.param, "invalid_value")
    return JSONResponse(body, 400)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)


async def unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    # Never a stack trace in a response; the log keeps it.
    log.error("internal error serving %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body("internal error", "server_error"), 500)
