"""``/v1/embeddings``: OpenAI's embeddings over the engine.

Each input is one engine request with ``pooling`` (`Engine.submit`): prefill only, admitted
under the same slots, KV reservations, classes and queue as every other request, so
embeddings never bypass the memory plan; its final hidden states are pooled and
L2-normalised by the engine: as slotserve's ``pooling`` field says (``mean``, ``cls``,
``last``), else as the model's GGUF says (``pooling_type``), else ``mean``. Inputs
go in waves of at most ``max_seqs``, each wave admitted whole or refused whole; a client
that disconnects cancels them. ``dimensions`` is refused unless it is the model's width
(no model served here is trained to be truncated).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field, field_validator

from slotserve.engine import Engine, RequestHandle
from slotserve.engine.events import Pooling, Priority, check_priority
from slotserve.errors import AdmissionRefused
from slotserve.sampling import SamplingParams
from slotserve.server.http.errors import APIError, refusal_error
from slotserve.server.http.generation import collect
from slotserve.server.http.state import ServerState
from slotserve.server.openai.completions import check_finish
from slotserve.server.openai.schemas import Body

INVALID = "invalid_request_error"
MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
DISCONNECT_POLL_S = 0.05  # how often a waiting encoder request checks its client


class EmbeddingRequest(Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    priority: Priority | None = None  # slotserve's: the class of its requests
    pooling: Pooling | None = None  # slotserve's: how the hidden states become one vector

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        many = isinstance(value, list) and value and isinstance(value[0], str | list)
        inputs = value if many else [value]
        if not inputs or len(inputs) > MAX_INPUTS:
            raise ValueError(f"give 1 to {MAX_INPUTS} inputs, not {len(inputs)}")
        for index, item in enumerate(inputs):
            if item in ("", []):
                raise ValueError(f"input {index} is empty")
        return value

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [[int(t) for t in value]]
        return list(value)  # type: ignore[arg-type]


def _checked_priority(body: EmbeddingRequest, width: int, request: Request) -> Priority:
    """The request's priority class, once ``dimensions`` (if given) is the model's
    ``width``: a 400 naming the field otherwise."""
    if body.dimensions is not None and body.dimensions != width:
        message = (
            f"dimensions: this model's embeddings have {width} dimensions and cannot be "
            f"shortened to {body.dimensions}; leave dimensions out"
        )
        raise APIError(400, message, INVALID, "dimensions", "unsupported_value")
    try:
        return check_priority(body.priority or request.headers.get("x-priority") or "normal")
    except ValueError as exc:
        raise APIError(400, f"X-Priority: {exc}", INVALID, "priority") from None


async def embed(
    state: ServerState, engine: Engine, body: EmbeddingRequest, request: Request
) -> dict[str, Any]:
    """The embeddings response for ``body``: one vector per input, in input order."""
    if not engine.embeds:
        raise APIError(400, "this model cannot embed (a bundle)", INVALID, code="unsupported_model")
    priority = _checked_priority(body, engine.model.info.dim, request)
    tokenizer = engine.model.tokenizer
    prompts = [tokenizer.encode(x) if isinstance(x, str) else x for x in body.inputs()]
    params = SamplingParams(max_new_tokens=0)
    vectors: list[tuple[float, ...]] = []
    prompt_tokens = 0
    wave = engine.config.max_seqs
    for start in range(0, len(prompts), wave):
        handles = _submit_wave(engine, prompts[start : start + wave], params, priority, body)
        for outcome in await collect(handles, request):
            assert outcome.final is not None
            check_finish(outcome.final)
            assert outcome.final.embedding is not None  # a request that ran its prompt
            vectors.append(outcome.final.embedding)
            prompt_tokens += outcome.final.usage.prompt_tokens
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": state.model_name, "usage": usage}


def _submit_wave(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: Priority,
    body: EmbeddingRequest,
) -> list[RequestHandle]:
    """Submit one embedding request per prompt: all admitted (or queued), or none left."""
    handles: list[RequestHandle] = []
    pooling = body.pooling or engine.model.info.pooling or "mean"
    try:
        for prompt in prompts:
            handles.append(engine.submit(prompt, params, priority, pooling=pooling))
    except (AdmissionRefused, ValueError) as exc:
        for handle in handles:
            handle.cancel()
        if isinstance(exc, AdmissionRefused):
            raise refusal_error(exc, "input") from None
        raise APIError(400, f"input: {exc}", INVALID, "input", "invalid_value") from None
    return handles


def _encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def embed_texts(
    state: ServerState, encoder: Any, body: EmbeddingRequest, request: Request
) -> dict[str, Any]:
    """The embeddings response of an encoder model (`EncoderEngine`): every input text in
    one request, admitted whole or refused whole, batched with others of its class, and
    cancelled when the client disconnects. Its pooling and normalisation are the model's
    own (sentence-transformers' modules), so ``pooling`` is refused; inputs must be text."""
    inputs = body.inputs()
    if not all(isinstance(x, str) for x in inputs):
        message = "input: this embedding model takes text, not token ids; send strings"
        raise APIError(400, message, INVALID, "input", "invalid_value")
    if body.pooling is not None:
        message = "pooling: this embedding model pools as its own modules say; leave it out"
        raise APIError(400, message, INVALID, "pooling", "unsupported_value")
    priority = _checked_priority(body, encoder.model.info.dim, request)
    try:
        handle = encoder.submit([str(x) for x in inputs], priority, may_queue=True)
    except AdmissionRefused as refusal:
        raise refusal_error(refusal, "input") from None
    except ValueError as exc:
        raise APIError(400, f"input: {exc}", INVALID, "input", "invalid_value") from None
    waiting = asyncio.ensure_future(asyncio.to_thread(handle.result))
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if not waiting.done() and await request.is_disconnected():
            handle.cancel()
            raise APIError(499, "client disconnected", "client_closed")
    result = waiting.result()
    if result.reason != "stop":
        raise APIError(503, f"the embedding request ended {result.reason}", "server_error")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(tuple(row), body.encoding_format)}
        for i, row in enumerate(result.embeddings.tolist())
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": state.model_name, "usage": usage}
