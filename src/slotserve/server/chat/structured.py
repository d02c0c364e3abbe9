"""What a request asks of the sampler beyond the plain numbers: its one constraint on the
output as a `Grammar` (structured outputs: ``response_format``, llama.cpp's ``grammar``
(GBNF) and ``json_schema``, vLLM's ``guided_json``/``guided_regex``/``guided_choice``/
``guided_grammar`` and ``structured_outputs``; `request_constraint`) and ``logit_bias``
checked against the vocabulary. A grammar, whatever its syntax, is compiled as a schema is.

A schema or grammar from a client is compiled in the compiler's bounded pool
(`GrammarCompiler.submit`: a worker process that is killed past ``--grammar-timeout`` or
``--grammar-max-bytes``, one compile at a time by default, queued behind
``--grammar-queue-timeout``), never on the event loop and never at the engine's priority;
a client that goes away while its schema waits or compiles cancels it. Grammars are kept
in an LRU by text, bounded in bytes (``--grammar-cache-bytes``, the grammars arena of the
memory plan): every grammar alive, cached or still used by a running request, is counted
until it is freed. The server state owns one cache for its model, with one
`GrammarCompiler`, so the tokenizer index is built once: by the ``serve`` command at
start, where the plan counts it (`configure` hands that compiler to the cache;
`slotserve.sampling.grammar_index`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from slotserve.engine import Engine, Finished
from slotserve.model import Model
from slotserve.sampling import Grammar, GrammarCompiler, GrammarError
from slotserve.sampling.grammar import (
    CompileJob,
    GrammarBusy,
    GrammarCancelled,
    GrammarConfig,
    GrammarLimitError,
    JobKind,
    schema_text,
)
from slotserve.server.http.errors import RETRY_AFTER_S, APIError
from slotserve.server.openai.schemas import SamplingFields

GRAMMAR_CACHE_SIZE = 32  # grammars kept at most, whatever their bytes
REFUSED_CACHE_SIZE = 256  # schemas remembered as refused, so a repeat costs no compile
SCHEMA_PARAM = "response_format.json_schema.schema"
DISCONNECT_POLL_S = 0.05
INVALID = "invalid_request_error"

_configured = GrammarConfig()


def configure(config: GrammarConfig) -> None:
    """The `GrammarConfig` of the grammar caches made from now on in this process (the
    ``serve`` command's ``--grammar-*`` flags; the server state makes its cache itself)."""
    global _configured
    _configured = config


def configured() -> GrammarConfig:
    return _configured


def _compiler_for(
    model: Model, config: GrammarConfig, prepared: GrammarCompiler | None
) -> GrammarCompiler:
    """``prepared`` (the compiler whose tokenizer index ``serve`` built and counted in the
    plan at start) where it is this model's (same tokenizer, logits width and config),
    else a new one."""
    if prepared is not None:
        same = prepared.tokenizer is model.tokenizer and prepared.config == config
        if same and prepared.vocab_size == model.info.vocab_size:
            return prepared
    return GrammarCompiler(model.tokenizer, model.info.vocab_size, config)


class _Pending:
    """A compile some requests wait for; cancelled when the last of them leaves."""

    def __init__(self, job: CompileJob[Grammar], finished: threading.Event) -> None:
        self.job = job
        self.waiters = 1
        self.finished = finished  # set once the cache has taken the compile's outcome


class GrammarCache:
    """One served model's grammars by schema text, least recently used dropped first, all
    compiled by its one `GrammarCompiler` (one tokenizer index). Bounded by ``size``
    grammars and by ``config.cache_bytes``: each grammar is charged its measured bytes
    (`Grammar.nbytes`) from before it is built here until it is freed, so one that a
    running request still uses after eviction stays counted. Owned by the server state; any
    thread may call `get` or `lookup`."""

    def __init__(
        self,
        model: Model,
        size: int = GRAMMAR_CACHE_SIZE,
        config: GrammarConfig | None = None,
        compiler: GrammarCompiler | None = None,
    ) -> None:
        self.size = size
        self.config = config or configured()
        self.compiler = _compiler_for(model, self.config, compiler)
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._refused: OrderedDict[str, GrammarError] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.RLock()  # a grammar's finalizer may run inside an eviction
        self.live_bytes = 0  # every grammar alive or reserved, cached or in use

    def get(self, schema: dict[str, Any] | None) -> Grammar:
        """The grammar for ``schema`` (None: any JSON object), waiting for its compile;
        raises `GrammarError`, `GrammarBusy` or `GrammarCancelled`."""
        found = self.lookup(schema)
        if isinstance(found, Grammar):
            return found
        try:
            grammar = found.job.result()
        except GrammarBusy:
            self.leave(found)
            raise
        # The future wakes its waiters before it runs its callbacks: wait for `_finish`, so
        # that the grammar is cached (and the least recently used evicted) when this returns.
        found.finished.wait()
        return grammar

    def lookup(self, schema: dict[str, Any] | None) -> Grammar | _Pending:
        """The cached grammar, or the compile to wait for (joined when one for the same
        schema is under way; `leave` it when no longer waiting). Raises `GrammarError` at
        once for a schema refused before."""
        return self._lookup(
            schema_text(schema), lambda reserve: self.compiler.submit(schema, reserve)
        )

    def lookup_grammar(
        self, grammar: str, description: str, kind: JobKind = "grammar"
    ) -> Grammar | _Pending:
        """As `lookup`, for grammar text (llguidance's: a reply's tool calls, a client's
        Lark; or of another `JobKind`: GBNF, a regular expression), cached and bounded as
        schemas are; ``description`` names it in errors."""
        return self._lookup(
            f"{kind}:{grammar}",  # schema texts are JSON: never this prefix
            lambda reserve: self.compiler.submit_grammar(grammar, description, reserve, kind),
        )

    def _lookup(
        self, key: str, submit: Callable[[Callable[[int], None]], CompileJob[Grammar]]
    ) -> Grammar | _Pending:
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
            if key in self._refused:
                raise self._refused[key]
            pending = self._pending.get(key)
            if pending is not None and not pending.job.future.cancelled():
                pending.waiters += 1
                return pending
            reserved = [0]
            finished = threading.Event()
            job = submit(lambda nbytes: self._reserve(nbytes, reserved))
            pending = self._pending[key] = _Pending(job, finished)
        # The callback holds no reference to the job: a cycle through the future would keep
        # its grammar alive after eviction until the cyclic collector ran.
        job.future.add_done_callback(lambda future: self._finish(key, future, reserved, finished))
        return pending

    def leave(self, pending: _Pending) -> None:
        """One waiter of ``pending`` went away; the last one cancels the compile."""
        with self._lock:
            pending.waiters -= 1
            last = pending.waiters <= 0
        if last:
            pending.job.cancel()

    def close(self) -> None:
        """Stop every compile (their workers are killed); returns at once."""
        self.compiler.close()

    @property
    def cached(self) -> int:
        with self._lock:
            return len(self._grammars)

    def _reserve(self, nbytes: int, reserved: list[int]) -> None:
        """Room for a grammar of ``nbytes``: evict the least recently used until it fits;
        `GrammarBusy` if the grammars that running requests hold leave no room."""
        budget = self.config.cache_bytes
        with self._lock:
            while self._grammars and self.live_bytes + nbytes > budget:
                self._grammars.popitem(last=False)  # freed (and uncounted) once unused
            if self.live_bytes + nbytes > budget:
                raise GrammarBusy(
                    f"the grammars running requests use hold {self.live_bytes / 2**20:.1f} MiB "
                    f"of --grammar-cache-bytes {budget / 2**20:.0f} MiB, and this one needs "
                    f"{nbytes / 2**20:.1f} MiB; retry when they finish, or raise "
                    "--grammar-cache-bytes"
                )
            self.live_bytes += nbytes
            reserved[0] = nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def _finish(
        self, key: str, future: Future[Grammar], reserved: list[int], finished: threading.Event
    ) -> None:
        """A compile ended (any thread): cache its grammar, remember a refusal, or give back
        what it reserved; then set ``finished``."""
        try:
            self._take(key, future, reserved)
        finally:
            finished.set()

    def _take(self, key: str, future: Future[Grammar], reserved: list[int]) -> None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and pending.job.future is future:
                del self._pending[key]
            error = None if future.cancelled() else future.exception()
            if future.cancelled() or error is not None:
                if reserved[0]:
                    self.live_bytes -= reserved[0]
                if isinstance(error, GrammarError):
                    self._refused[key] = error
                    while len(self._refused) > REFUSED_CACHE_SIZE:
                        self._refused.popitem(last=False)
                return
            grammar = future.result()
            weakref.finalize(grammar, self._release, reserved[0])
            self._grammars[key] = grammar
            while len(self._grammars) > self.size:
                self._grammars.popitem(last=False)


@dataclass(frozen=True)
class Constraint:
    """One constraint on a request's output: the field that gave it (``param``, named by
    its errors) and what compiles, a JSON schema (``kind`` ``"schema"``: ``schema``, None
    for any JSON object) or grammar text of another `JobKind` (``text``, ``description``
    naming it in errors)."""

    param: str
    kind: JobKind
    schema: dict[str, Any] | None = None
    text: str = ""
    description: str = "JSON schema"


def choice_grammar(choices: list[str]) -> str:
    """The Lark grammar whose outputs are exactly ``choices``."""
    return "start: " + " | ".join(json.dumps(choice) for choice in choices) + "\n"


def _json_schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """A schema given as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise APIError(400, f"{param}: not JSON: {exc}", INVALID, param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema is an object", INVALID, param=param)
    return schema


def _grammar(param: str, text: str) -> Constraint:
    """A grammar field: GBNF as llama.cpp reads it, or Lark (llguidance's own syntax,
    recognised by a ``start:`` rule or a ``%llguidance`` line) as vLLM's guidance reads it."""
    return Constraint(param, "gbnf", text=text, description=f"{param} (GBNF or Lark)")


def _constraints(body: SamplingFields) -> list[Constraint]:
    """Every constraint ``body`` gives, in the order of the fields below."""
    found: list[Constraint] = []
    form = body.response_format
    if form is not None and form.type == "json_schema":
        assert form.json_schema is not None  # ResponseFormat checks it
        found.append(Constraint(SCHEMA_PARAM, "schema", form.json_schema.schema_ or {}))
    elif form is not None and form.type == "json_object" and form.schema_ is not None:
        param = "response_format.schema"  # llama.cpp's: JSON valid under this schema
        found.append(Constraint(param, "schema", _json_schema(form.schema_, param)))
    elif form is not None and form.type == "json_object":
        found.append(Constraint("response_format", "schema"))
    if body.json_schema is not None:
        found.append(Constraint("json_schema", "schema", body.json_schema))
    if body.grammar is not None:
        found.append(_grammar("grammar", body.grammar))
    if body.guided_json is not None:
        found.append(
            Constraint("guided_json", "schema", _json_schema(body.guided_json, "guided_json"))
        )
    if body.guided_regex is not None:
        found.append(
            Constraint("guided_regex", "regex", text=body.guided_regex, description="guided_regex")
        )
    if body.guided_choice is not None:
        found.append(
            Constraint(
                "guided_choice",
                "grammar",
                text=choice_grammar(body.guided_choice),
                description="guided_choice",
            )
        )
    if body.guided_grammar is not None:
        found.append(_grammar("guided_grammar", body.guided_grammar))
    outputs = body.structured_outputs
    if outputs is not None:
        if outputs.json_ is not None:
            param = "structured_outputs.json"
            found.append(Constraint(param, "schema", _json_schema(outputs.json_, param)))
        if outputs.json_object:
            found.append(Constraint("structured_outputs.json_object", "schema"))
        if outputs.regex is not None:
            param = "structured_outputs.regex"
            found.append(Constraint(param, "regex", text=outputs.regex, description=param))
        if outputs.choice is not None:
            param = "structured_outputs.choice"
            if not outputs.choice or any(not choice for choice in outputs.choice):
                raise APIError(
                    400, f"{param}: give one or more non-empty strings", INVALID, param=param
                )
            found.append(
                Constraint(param, "grammar", text=choice_grammar(outputs.choice), description=param)
            )
        if outputs.grammar is not None:
            found.append(_grammar("structured_outputs.grammar", outputs.grammar))
    return found


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The one constraint on ``body``'s output (None: free text); two are a 400 naming the
    second (`response_format`, llama.cpp's ``grammar`` and ``json_schema``, vLLM's
    ``guided_*`` and ``structured_outputs``)."""
    found = _constraints(body)
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise APIError(
            400,
            f"{second}: a request takes one constraint on its output, and {first} already "
            "gives one; send only one of them",
            INVALID,
            param=second,
        )
    return found[0] if found else None


async def response_grammar(
    grammars: GrammarCache, body: SamplingFields, request: Request | None = None
) -> Grammar | None:
    """The grammar the request's constraint asks for (`request_constraint`; None for free
    text); a schema or grammar the grammar engine cannot honour, or one past a compile
    bound, is a 400 that names the field and what it does not support or the bound. While
    it compiles, a client that disconnects cancels it."""
    constraint = request_constraint(body)
    if constraint is None:
        return None
    if body.ignore_eos:
        raise APIError(
            400,
            f"ignore_eos cannot be combined with {constraint.param}: the output must end "
            "where its grammar does",
            INVALID,
            param="ignore_eos",
        )
    if constraint.kind == "schema":
        schema = constraint.schema
        return await compiled(grammars, lambda: grammars.lookup(schema), request, constraint.param)
    return await compiled(
        grammars,
        lambda: grammars.lookup_grammar(constraint.text, constraint.description, constraint.kind),
        request,
        constraint.param,
        refused="unsupported_grammar",
    )


async def compiled(
    grammars: GrammarCache,
    lookup: Callable[[], Grammar | _Pending],
    request: Request | None,
    param: str,
    refused: str = "unsupported_schema",
) -> Grammar:
    """The grammar ``lookup`` finds or starts compiling in ``grammars``' bounded pool,
    waited for as `_wait` does. Each way it can fail is the API's error naming ``param``:
    a schema or grammar the engine refuses is a 400 with code ``refused``, one past a
    compile bound a 400 ``schema_too_complex``, no compile slot in time a 429, shutdown a
    503."""
    try:
        found = lookup()
        if isinstance(found, Grammar):
            return found
        return await _wait(grammars, found, request)
    except GrammarLimitError as exc:
        raise APIError(
            400, f"{param}: {exc}", "invalid_request_error", param=param, code="schema_too_complex"
        ) from None
    except GrammarError as exc:
        raise APIError(
            400, f"{param}: {exc}", "invalid_request_error", param=param, code=refused
        ) from None
    except GrammarBusy as exc:
        raise APIError(
            429,
            f"{param}: {exc}",
            "rate_limit_error",
            param=param,
            code="grammar_busy",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except GrammarCancelled:
        raise APIError(
            503, "the request was cancelled: the server is shutting down", "server_error"
        ) from None


async def _wait(grammars: GrammarCache, pending: _Pending, request: Request | None) -> Grammar:
    """Wait for ``pending`` without blocking the event loop or cancelling it for others:
    up to the queue's deadline for a worker (then `GrammarBusy`), then as long as its
    bounds allow; leave it if the client disconnects, the server shuts down (503 at once:
    shutdown never waits for a compile) or this task is cancelled."""
    job = pending.job
    ready = _completion(job.future)
    server = getattr(request.app.state, "server", None) if request is not None else None
    try:
        while not job.future.done():
            await asyncio.wait({ready}, timeout=DISCONNECT_POLL_S)
            if job.future.done():
                break
            if getattr(server, "shutting_down", False):
                raise GrammarCancelled("the server is shutting down")
            if request is not None and await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_closed")
            if time.monotonic() > job.deadline and job.expire():
                raise GrammarBusy(job.busy_message())
        if job.future.cancelled():
            raise GrammarBusy(job.busy_message())  # expired by another waiter
        return job.future.result()
    except BaseException:
        grammars.leave(pending)
        raise


def _completion(job: Future[Grammar]) -> asyncio.Future[None]:
    """An event-loop future that completes, with no result, when ``job`` does. The
    outcome stays on ``job`` alone: an `asyncio.wrap_future` copy holding a compile's
    exception logged "Future exception was never retrieved" (with a traceback) when a
    waiter had left and the server stopped before reading it."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    def on_done(_: Future[Grammar]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(wake)

    job.add_done_callback(on_done)
    return ready


def output_refusal(
    grammar: Grammar | None, final: Finished, param: str = SCHEMA_PARAM
) -> APIError | None:
    """The error for a constrained choice that ended on end-of-sequence with output the
    grammar does not accept (its matcher went into error mid-document, and the sampler
    then allowed only end-of-sequence): never reported as a finished ("stop") document.
    None when the output is complete, or did not end on end-of-sequence (a stop string or
    the token budget cut it, as the finish reason says)."""
    if grammar is None or final.reason != "stop" or final.eos_token is None:
        return None
    reason = grammar.refusal(final.tokens)
    if reason is None:
        return None
    return APIError(
        500,
        f"{param}: the grammar engine could not enforce it to the end of the "
        f"document ({reason}), so the output is not valid; simplify it (fewer "
        "properties or alternatives)",
        "server_error",
        param=param,
        code="grammar_failed",
    )


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
