"""The HTTP routes: OpenAI's chat/completions/embeddings/responses/models, Anthropic's
messages, plus health, metrics, slots and tokenize/detokenize."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from slotserve.engine import Engine, EngineStats
from slotserve.engine.cancel_bound import CancelBound
from slotserve.engine.views import with_parked_slots
from slotserve.errors import AdmissionRefused
from slotserve.server.anthropic import messages as anthropic
from slotserve.server.chat.tools import plan_tools
from slotserve.server.http.errors import APIError, refusal_error
from slotserve.server.http.security import KeyedRoute, require_api_key, require_metrics_key
from slotserve.server.http.state import ServerState
from slotserve.server.openai.chat import generate_chat
from slotserve.server.openai.completions import chat_text, chat_tokens, generate
from slotserve.server.openai.embeddings import EmbeddingRequest, embed, embed_texts
from slotserve.server.openai.peer_fields import ignored_header
from slotserve.server.openai.schemas import (
    ApplyTemplateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from slotserve.server.responses.api import create_response
from slotserve.server.responses.request import ResponsesRequest

# redirect_slashes=False everywhere: see create_app. `v1` (OpenAI's routes) is mounted both
# at /v1 and at the root, as the peers do; `guarded` holds live activity and CPU work;
# health stays open, and metrics too unless --metrics-key is given. KeyedRoute: the keys
# are checked from the request head, before the body is read.
_KEY = [Depends(require_api_key)]
V1_PREFIX = "/v1"
v1 = APIRouter(dependencies=_KEY, redirect_slashes=False, route_class=KeyedRoute)
guarded = APIRouter(dependencies=_KEY, redirect_slashes=False, route_class=KeyedRoute)
plain = APIRouter(redirect_slashes=False, route_class=KeyedRoute)
log = logging.getLogger("slotserve")


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def live_engine(state: ServerState) -> Engine:
    """The engine, if it takes requests now; else 503 (loading, or shutting down)."""
    if state.shutting_down or (state.engine is not None and state.engine.closed):
        raise APIError(503, "the server is shutting down; retry elsewhere", "server_error")
    if state.engine is None:
        raise APIError(503, "the model is not ready (still loading)", "server_error")
    return state.engine


def check_model(state: ServerState, name: str) -> None:
    served = state.models.names if state.models is not None else [state.model_name]
    if name not in served:
        listed = ", ".join(f"'{n}'" for n in served)
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves {listed}",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )


@asynccontextmanager
async def served(
    request: Request, name: str, *, embeddings: bool = False
) -> AsyncIterator[tuple[ServerState, Any]]:
    """The state (as model ``name`` sees it) and the engine of the model a request names.
    One model: the engine, then the name checked (404 ``model_not_found``). A set: the
    name checked, then the model leased (`ModelSet.lease`: loaded first when it is not,
    off the event loop) until the block ends, so it is not unloaded before the request is
    submitted; a load without room is 429 ``model_capacity`` with Retry-After. An
    embedding model (an encoder engine) serves only ``embeddings`` routes: elsewhere 400."""
    state = state_of(request)
    models = state.models
    if models is None:
        engine = live_engine(state)
        check_model(state, name)
        yield state, engine
        return
    live_engine(state)  # 503 while shutting down
    check_model(state, name)
    try:
        engine = await asyncio.to_thread(models.acquire, name)
    except AdmissionRefused as refusal:
        raise refusal_error(refusal) from None
    try:
        if not isinstance(engine, Engine) and not embeddings:
            raise APIError(
                400,
                f"the model '{name}' is an embedding model; send it to /v1/embeddings",
                "invalid_request_error",
                param="model",
                code="model_not_supported",
            )
        yield state.view_of(name, engine), engine
    finally:
        models.release(name)


class Reported(Protocol):
    """A request body that keeps the fields no API defines apart (chat, completions,
    Responses, Anthropic's)."""

    def ignored(self) -> list[str]: ...


def reported(response: Response, body: Reported) -> Response:
    """``response`` with the fields of ``body`` that no API defines reported: listed in its
    ``X-Slotserve-Ignored-Fields`` header, and logged (`peer_fields`)."""
    ignored = body.ignored()
    if ignored:
        log.warning("ignored request fields that no supported API defines: %s", ignored)
        response.headers.update(ignored_header(ignored))
    return response


# Every chat, from any API, takes one path to the engine, `chat.run.start_chat`: OpenAI's
# chat completions (`openai.chat.generate_chat`), the Responses API (`create_response`) and
# Anthropic's Messages (`anthropic.create_message`) each turn the request into a chat
# request, submit it there, and answer its reply in their own shape.
@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    async with served(request, body.model) as (state, engine):
        return reported(await generate_chat(state, engine, body, request), body)


@v1.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    async with served(request, body.model) as (state, engine):
        return reported(await generate(state, engine, body, request), body)


@v1.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    async with served(request, body.model, embeddings=True) as (state, engine):
        if isinstance(engine, Engine):
            return await embed(state, engine, body, request)
        return await embed_texts(state, engine, body, request)


@v1.post("/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    async with served(request, body.model) as (state, engine):
        return reported(await create_response(state, engine, body, request), body)


@v1.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    stored = state_of(request).responses.get(response_id)
    if stored is None:
        message = f"no stored response has id {response_id!r}"
        raise APIError(404, message, "invalid_request_error", param="response_id")
    return stored.response


async def messages(request: Request) -> Response:
    """Anthropic's Messages API; every error in its own shape (`anthropic.error_response`)."""
    try:
        live_engine(state_of(request))  # 503 before the body is read
        body = await anthropic.parsed(request, anthropic.MessagesRequest)
        async with served(request, body.model) as (state, engine):
            return reported(await anthropic.create_message(state, engine, body, request), body)
    except APIError as exc:
        return anthropic.error_response(exc.status, exc.message, exc.headers)


async def count_tokens(request: Request) -> Response:
    try:
        live_engine(state_of(request))  # 503 before the body is read
        body = await anthropic.parsed(request, anthropic.CountTokensRequest)
        async with served(request, body.model) as (_state, engine):
            return reported(JSONResponse(await anthropic.count_tokens(engine, body)), body)
    except APIError as exc:
        return anthropic.error_response(exc.status, exc.message, exc.headers)


# Anthropic's routes answer a refused key in that API's error shape too (AnthropicRoute).
v1.add_api_route(
    "/messages", messages, methods=["POST"], route_class_override=anthropic.AnthropicRoute
)
v1.add_api_route(
    "/messages/count_tokens",
    count_tokens,
    methods=["POST"],
    route_class_override=anthropic.AnthropicRoute,
)


@v1.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    if state.models is not None:
        return {"object": "list", "data": _set_cards(state)}
    return {"object": "list", "data": [_model_card(state)]}


@v1.get("/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    check_model(state, model)
    if state.models is not None:
        return next(card for card in _set_cards(state) if card["id"] == model)
    return _model_card(state)


def _set_cards(state: ServerState) -> list[dict[str, Any]]:
    """Each model of the served set: OpenAI's card, with slotserve's state (loaded,
    loading, unloaded), planned bytes and kind (generate, embed)."""
    assert state.models is not None
    return [
        {
            "id": card["id"],
            "object": "model",
            "created": state.created,
            "owned_by": "slotserve",
            "slotserve": {k: v for k, v in card.items() if k != "id"},
        }
        for card in state.models.cards()
    ]


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "slotserve",
    }
    if state.engine is not None:  # which layer halves and kernels run it (slotserve's own)
        model = state.engine.model
        card["slotserve"] = {"halves": model.halves.kind, "kernels": model.kernels.describe()}
    return card


@plain.get("/health")
async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if state.engine is None:
        return JSONResponse({"status": "loading"}, 503)
    if state.shutting_down or state.engine.closed:
        return JSONResponse({"status": "closed"}, 503)
    return JSONResponse({"status": "ok", "model": state.model_name})


@plain.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(request: Request) -> Response:
    state = state_of(request)
    if state.metrics is None:
        raise APIError(503, "the model is not ready", "server_error")
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")


@guarded.get("/slots")
async def slots(request: Request, model: str | None = None) -> JSONResponse:
    """Each slot (a list, as llama.cpp's ``/slots``); an idle slot that keeps a finished
    request's KV for the prefix cache says ``parked`` (free to take all the same). What
    holds for every slot of one engine rides in headers: the device-pressure level, when a
    signal is configured (``X-Pressure-Level``), the declared cancellation bound
    (`cancel_bound_headers`) and the KV in use beside what of it is parked
    (`kv_headers`). A served set lists every loaded generating model's slots, each with
    its ``model``; ``?model=NAME`` lists that model's alone, with its headers (an unknown
    name is 404 ``model_not_found``; an unloaded or embedding model has no slots)."""
    state = state_of(request)
    engine = live_engine(state)
    if model is not None:
        check_model(state, model)
    if state.models is None:
        headers = slot_headers(engine)  # read first, as the slots were always
        return JSONResponse(slot_list(engine), headers=headers)
    one = state.models.engine(model) if model is not None else None
    headers = slot_headers(one) if isinstance(one, Engine) else {}
    listed: list[dict[str, object]] = []
    for name in state.models.names if model is None else [model]:
        each = state.models.engine(name)  # no lease: a view, as /v1/models is
        if isinstance(each, Engine):
            listed += [{"model": name, **slot} for slot in slot_list(each)]
    return JSONResponse(listed, headers=headers)


def slot_list(engine: Engine) -> list[dict[str, object]]:
    """The engine's slots, parked ones marked (`with_parked_slots`), JSON-ready."""
    return [slot.to_dict() for slot in with_parked_slots(engine.slots(), engine.pool_view())]


def slot_headers(engine: Engine) -> dict[str, str]:
    """The headers of ``engine``'s slots (`slots`)."""
    stats = engine.stats()
    headers = {} if stats.cancel_bound is None else cancel_bound_headers(stats.cancel_bound)
    if stats.pressure_level is not None:
        headers["X-Pressure-Level"] = f"{stats.pressure_level:g}"
    headers.update(kv_headers(stats))
    return headers


def kv_headers(stats: EngineStats) -> dict[str, str]:
    """The pool's blocks (or rows) in use (``X-KV-Blocks-Used``), what of them only the
    prefix cache holds (``X-KV-Blocks-Parked``: reclaimable, not leaked) and the slots it
    parks (``X-Slots-Parked``)."""
    return {
        "X-KV-Blocks-Used": str(stats.kv_blocks_used),
        "X-KV-Blocks-Parked": str(stats.kv_blocks_parked),
        "X-Slots-Parked": str(stats.slots_parked),
    }


def cancel_bound_headers(bound: CancelBound) -> dict[str, str]:
    """The declared worst-case cancel→release time of a slot: ``X-Cancel-Bound-Seconds``
    (the time of the largest step the config allows, absent before a step was measured),
    ``X-Cancel-Bound-Basis`` (how it was estimated), ``X-Cancel-Bound-Step-Tokens`` (that
    step's size) and, once cancels were measured, ``X-Cancel-Release-P99-Seconds`` beside
    it; ``X-Cancel-Bound`` says it all in one line (ASCII: a header is Latin-1)."""
    headers = {
        "X-Cancel-Bound": bound.describe().replace("→", "->"),
        "X-Cancel-Bound-Basis": bound.basis,
        "X-Cancel-Bound-Step-Tokens": str(bound.max_step_tokens),
    }
    if bound.estimate_s is not None:
        headers["X-Cancel-Bound-Seconds"] = f"{bound.estimate_s:.6f}"
    if bound.measured_p99_s is not None:
        headers["X-Cancel-Release-P99-Seconds"] = f"{bound.measured_p99_s:.6f}"
    return headers


@guarded.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    engine = live_engine(state_of(request))
    tokenizer = engine.model.tokenizer
    if body.messages is not None:
        tokens = chat_tokens(
            engine,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
        )
    elif body.text is not None:
        tokens = tokenizer.encode(body.text)
    else:
        raise APIError(400, "give text or messages", "invalid_request_error", param="text")
    return {"tokens": tokens, "count": len(tokens)}


@guarded.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> dict[str, Any]:
    """llama.cpp's route: the prompt text a chat request's messages and tools make, as the
    chat route renders it (its tools as it offers them, its ``chat_template_kwargs``)."""
    name = body.model if body.model is not None else state_of(request).model_name
    async with served(request, name) as (_state, engine):
        chat = body.chat(name)
        plan = plan_tools(engine.model.tokenizer, chat)
        prompt = chat_text(
            engine,
            chat.messages,
            add_generation_prompt=body.add_generation_prompt,
            tools=plan,
            template_kwargs=chat.chat_template_kwargs,
        )
    return {"prompt": prompt}


@guarded.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    engine = live_engine(state_of(request))
    vocab = engine.model.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400,
            f"tokens: {bad[0]} is not in 0..{vocab - 1}",
            "invalid_request_error",
            param="tokens",
        )
    return {"text": engine.model.tokenizer.decode(body.tokens)}
