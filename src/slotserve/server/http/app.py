"""`create_app`: the FastAPI application around one engine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotserve.engine import Engine
from slotserve.engine.models import ModelSet
from slotserve.sampling.grammar import GrammarCompiler
from slotserve.server.chat.defaults import SamplingDefaults
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.http.connections import ConnectionTracker
from slotserve.server.http.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    unexpected_handler,
    validation_handler,
)
from slotserve.server.http.security import BodyLimit
from slotserve.server.http.state import DEFAULT_MAX_BODY_BYTES, ServerState
from slotserve.server.ops import dashboard, page
from slotserve.server.routes import V1_PREFIX, guarded, plain, v1


def create_app(
    engine: Engine | None,
    model_name: str,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    sampling: SamplingDefaults | None = None,  # for fields a request leaves out
    metrics_key: str | None = None,  # required by /metrics when given
    cors_origins: Sequence[str] = (),  # browser origins allowed to call the API
    web: bool = True,
    connections: ConnectionTracker | None = None,  # the server's, exposed in /metrics
    reasoning_format: ReasoningFormat = "auto",  # a thinking model's, unless a request says
    grammar_compiler: GrammarCompiler | None = None,  # its tokenizer index built at start
    models: ModelSet | None = None,  # the served set, ``engine`` its first resident model
) -> FastAPI:
    """The app serving ``engine`` as ``model_name``; closing the app closes the engine.
        ``web``: serve the page at ``/`` and its files (`page`) and its dashboard feed
        (`dashboard`). ``connections``: the tracker of the protocol serving the app
        (`serve`), whose counts /metrics shows. ``models``: a served set of models
    (`ModelSet`), each request routed by its ``model`` field (docs/MODELS.md)."""
    state = ServerState(
        None,
        model_name,
        api_key,
        max_body_bytes,
        created=int(time.time()),
        sampling=sampling or SamplingDefaults(),
        metrics_key=metrics_key,
        connections=connections,
        reasoning_format=reasoning_format,
        grammar_compiler=grammar_compiler,
        models=models,
    )
    if models is not None and engine is not None:
        state.grammar_compiler = models.grammar_compiler(model_name)
    if engine is not None:
        state.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.finish_shutdown()  # cancels what runs: open streams end, slots are freed

    # No trailing-slash redirects: Starlette builds their Location from the client's Host
    # header, so "/v1/models/" would send a client to any host its request named.
    app = FastAPI(
        title="slotserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.state.server = state
    app.include_router(v1, prefix=V1_PREFIX)
    app.include_router(v1)  # the same routes without /v1, as the peers accept them
    app.include_router(guarded)
    app.include_router(plain)
    if web:
        app.include_router(page.router)
        app.include_router(dashboard.router)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_handler)
    app.add_middleware(BodyLimit, limit=max_body_bytes)  # refuses when a route reads
    if cors_origins:
        # Added last, so outermost: preflights are answered before any key check, and
        # error responses (401, 413) carry the CORS headers a browser needs to read them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Api-Key", "X-Priority"],
            max_age=600,
        )
    return app
