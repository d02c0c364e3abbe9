"""What a request asks of the sampler beyond the plain numbers: ``response_format`` as a
`Grammar` (structured outputs) and ``logit_bias`` checked against the vocabulary.

Grammars are compiled off the event loop (a large schema takes milliseconds to compile, the
first one for a model also builds its tokenizer's index) and kept in a small LRU by schema,
so a client that sends the same schema again pays nothing. The server state owns one cache
for its model, with one `GrammarCompiler`, so the tokenizer index is built once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

from slotserve.engine import Engine
from slotserve.model import Model
from slotserve.sampling import Grammar, GrammarCompiler, GrammarError
from slotserve.server.errors import APIError
from slotserve.server.schemas import SamplingFields

GRAMMAR_CACHE_SIZE = 32
SCHEMA_PARAM = "response_format.json_schema.schema"


class GrammarCache:
    """One served model's grammars by schema text, least recently used dropped first, all
    compiled by its one `GrammarCompiler` (one tokenizer index). Owned by the server state;
    any thread may call `get` (compiling happens outside the lock)."""

    def __init__(self, model: Model, size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.size = size
        self.compiler = GrammarCompiler(model.tokenizer, model.info.vocab_size)
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, schema: dict[str, Any] | None) -> Grammar:
        """The grammar for ``schema`` (None: any JSON object); raises `GrammarError`."""
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = self.compiler.json_schema(schema)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self.size:
                self._grammars.popitem(last=False)
        return grammar


async def response_grammar(grammars: GrammarCache, body: SamplingFields) -> Grammar | None:
    """The grammar ``response_format`` asks for (None for text); a schema the grammar
    engine cannot honour is a 400 that names what it does not support."""
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if body.ignore_eos:
        raise APIError(
            400,
            "ignore_eos cannot be combined with response_format: the output must end where "
            "the JSON does",
            "invalid_request_error",
            param="ignore_eos",
        )
    schema: dict[str, Any] | None = None
    if response_format.type == "json_schema":
        assert response_format.json_schema is not None  # ResponseFormat checks it
        schema = response_format.json_schema.schema_ or {}
    try:
        return await asyncio.to_thread(grammars.get, schema)
    except GrammarError as exc:
        raise APIError(
            400,
            f"{SCHEMA_PARAM}: {exc}",
            "invalid_request_error",
            param=SCHEMA_PARAM if schema is not None else "response_format",
            code="unsupported_schema",
        ) from None


def logit_bias(engine: Engine, body: SamplingFields) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; an id outside the vocabulary is a 400."""
    pairs = body.logit_bias_pairs()
    vocab = engine.model.info.vocab_size
    bad = [token for token, _ in pairs if token >= vocab]
    if bad:
        raise APIError(
            400,
            f"logit_bias: token id {bad[0]} is not in this model's vocabulary (0..{vocab - 1})",
            "invalid_request_error",
            param="logit_bias",
            code="invalid_value",
        )
    return pairs
