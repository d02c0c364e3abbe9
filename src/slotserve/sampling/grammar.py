"""Grammar constraints (structured outputs) with llguidance: `GrammarCompiler` turns a JSON
schema into a `Grammar` for one tokenizer and logits width, and each request advances a
`GrammarMatcher` of its own that masks the tokens the grammar forbids.

Two ways to compile. `GrammarCompiler.json_schema` compiles in the calling thread, for
schemas the caller trusts (benches, tests, library code). `GrammarCompiler.submit` is for
schemas from the network: llguidance offers no way to stop a compile (its `LLParserLimits`
fuel does not bound every step: an ``allOf`` of N patterns takes time and memory exponential
in N whatever the limits), so each compile first runs in a worker process that can be
killed, under the time and memory bounds of `GrammarConfig`; only a schema that compiled
there within them is compiled again here, where the grammar is needed. The workers are a
bounded pool (`GrammarConfig.workers`, one by default) at the lowest CPU priority, fed by a
queue with a deadline, so compiles never take the cores the engine decodes on.

Owns llguidance's objects and the worker processes; knows nothing of sampling parameters
or the batch. Module state: none (the tokenizer index and the pool live in the compiler
its owner keeps).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np
import torch

from slotserve.memory import rss_bytes
from slotserve.sampling.cpu import numpy_view_ok
from slotserve.tokenizer import Tokenizer
from slotserve.tokenizer.spm import SpmVocab

log = logging.getLogger("slotserve")

# JSON output uses fixed separators and no other whitespace: a small model offered free
# whitespace can emit newlines until its budget runs out, and compact output stays short.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own estimate of one lexer state ("approx. 1-2 kB per state"), the upper one.
LEXER_STATE_BYTES = 2048
# $ref hops followed without entering a property or an array item (a longer chain is
# refused: it is no grammar's limit, but Python validators recurse once per hop).
MAX_REF_CHAIN = 64
# How often a compile in a worker is checked against its bounds and its cancellation.
POLL_S = 0.01
_MIB = 2**20


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding: invalid, using a feature
    the grammar engine does not implement or cannot enforce (the message names it), or past
    a bound of `GrammarConfig` (`GrammarLimitError`)."""


class GrammarLimitError(GrammarError):
    """A schema whose compile went past a bound: ``limit`` names it (``"timeout"``,
    ``"memory"``), ``bound`` is its value (seconds or bytes)."""

    def __init__(self, message: str, limit: str, bound: float) -> None:
        super().__init__(message)
        self.limit, self.bound = limit, bound


class GrammarBusy(RuntimeError):
    """No compile slot came free before the queue's deadline (``queue_timeout_s``)."""


class GrammarCancelled(RuntimeError):
    """The compile was cancelled (its client went away, or the compiler was closed)."""


@dataclass(frozen=True)
class GrammarConfig:
    """The bounds on compiling grammars from schemas a client sent.

    ``timeout_s``: wall seconds one compile may take in its worker (``--grammar-timeout``).
    ``max_bytes``: one grammar's memory (``--grammar-max-bytes``): its worker may grow by at
    most this while compiling, and what the grammar keeps, plus what its lexer may add as
    requests use it (``lexer_states`` states, a quarter of ``max_bytes``), must fit in it.
    ``cache_bytes``: the grammars arena of the memory plan, every grammar alive (cached or
    in use) counted (``--grammar-cache-bytes``). ``workers``: compiles at once
    (``--grammar-workers``). ``queue_timeout_s``: how long a compile may wait for a worker
    (``--grammar-queue-timeout``).
    """

    timeout_s: float = 10.0
    max_bytes: int = 32 * _MIB
    cache_bytes: int = 128 * _MIB
    workers: int = 1
    queue_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, flag in (("timeout_s", "timeout"), ("queue_timeout_s", "queue-timeout")):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"grammar {name}={value!r} must be a number of seconds > 0: "
                    f"pass e.g. --grammar-{flag} 10"
                )
        if self.max_bytes < 4 * _MIB:
            raise ValueError(
                f"grammar max_bytes={self.max_bytes} is below the least a grammar needs, "
                f"{4 * _MIB} (4 MiB): pass e.g. --grammar-max-bytes 32MiB"
            )
        if self.cache_bytes < self.max_bytes:
            raise ValueError(
                f"grammar cache_bytes={self.cache_bytes} is below max_bytes={self.max_bytes}: "
                "the cache must hold at least one grammar; raise --grammar-cache-bytes or "
                "lower --grammar-max-bytes"
            )
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(
                f"grammar workers={self.workers!r} must be an integer in 1..64: "
                "pass e.g. --grammar-workers 1"
            )

    @property
    def lexer_states(self) -> int:
        """The lexer states one grammar may build (llguidance's ``max_lexer_states``)."""
        return self.max_bytes // 4 // LEXER_STATE_BYTES

    @property
    def lexer_bytes(self) -> int:
        """The bytes those states may take: charged to every grammar up front."""
        return self.lexer_states * LEXER_STATE_BYTES

    def limits(self) -> dict[str, int]:
        """llguidance's `LLParserLimits` for grammars under this config."""
        return {"max_lexer_states": self.lexer_states}


class GrammarCompiler:
    """Compiles grammars for one tokenizer and logits width.

    Owns llguidance's view of the tokenizer, built on the first compile (it walks the whole
    vocabulary: ~0.2 s for 49k tokens) and shared by every grammar compiled here, so whoever
    keeps a model's grammars keeps one compiler per model. Any thread may compile: the index
    is built once, under the compiler's lock. `submit` compiles in the bounded pool
    (`GrammarConfig`), started on its first use; `close` ends it.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, config: GrammarConfig | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config or GrammarConfig()
        self._index: Any = None  # llguidance.LLTokenizer, once built
        self._lock = threading.Lock()
        self._pool: _CompilePool | None = None

    def json_schema(self, schema: Mapping[str, Any] | None) -> Grammar:
        """Output that parses as JSON and validates against ``schema``; ``None``: any JSON
        object (OpenAI's ``json_object`` mode). Compiles here, unbounded in time: for
        trusted schemas (see `submit`). Raises `GrammarError` for a schema that uses a
        keyword llguidance does not implement (named), one it cannot enforce, or an invalid
        one."""
        text = schema_text(schema)
        return self._compile_schema(text, _charge(0, self.config))

    def submit(
        self,
        schema: Mapping[str, Any] | None,
        reserve: Callable[[int], None] | None = None,
    ) -> CompileJob:
        """Compile ``schema`` in the bounded pool: a `CompileJob` whose future gives the
        `Grammar`, or raises `GrammarError` (`GrammarLimitError` past a bound of the
        config), `GrammarBusy` (no worker before the queue's deadline) or
        `GrammarCancelled`. ``reserve(nbytes)`` is called once the grammar's size is known,
        before it is built here; it may raise `GrammarError` to refuse it."""
        text = schema_text(schema)
        check_schema(schema)  # cheap, and a refusal needs no worker
        job = CompileJob(text, self.config.queue_timeout_s, reserve)
        with self._lock:
            if self._pool is None:
                self._pool = _CompilePool(self)
            pool = self._pool
        pool.put(job)
        return job

    def close(self) -> None:
        """Kill the pool's workers (a compile under way ends with `GrammarCancelled`);
        returns at once. A later `submit` starts a new pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def compile(self, grammar: str, description: str, nbytes: int = 0) -> Grammar:
        """``grammar`` (llguidance's grammar text) as a `Grammar` charged ``nbytes``;
        ``description`` names it in errors. Raises `GrammarError` for a grammar llguidance
        rejects or one that admits no output."""
        import llguidance

        # log_level=0: a request's grammar failure is reported through GrammarError or our
        # own log, not printed by the library.
        limits = llguidance.LLParserLimits(max_lexer_states=self.config.lexer_states)
        template = llguidance.LLMatcher(
            self._tokenizer_index(), grammar, log_level=0, limits=limits
        )
        if template.is_error():
            raise GrammarError(f"{description}: {_first_line(template.get_error())}")
        start = template.deep_copy()
        if not _admits_output(start, self.vocab_size, self.tokenizer.eos_ids):
            raise GrammarError(
                f"{description}: it admits no document at all (no first token is allowed): "
                "give every $ref loop a way out, or remove the contradictory keywords"
            )
        forced = _forced_failure(start)
        if forced is not None:
            raise GrammarError(f"{description}: {forced}")
        return Grammar(template, self.vocab_size, self.tokenizer.eos_ids, description, nbytes)

    def _compile_schema(self, text: str, nbytes: int) -> Grammar:
        import llguidance

        check_schema(json.loads(text))
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text,
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not usable: {exc}") from None
        return self.compile(grammar, "JSON schema", nbytes)

    def _tokenizer_index(self) -> Any:
        """llguidance's view of the tokenizer over ``vocab_size`` logits, built once."""
        import llguidance

        with self._lock:
            if self._index is None:
                self._index = llguidance.LLTokenizer(
                    _llguidance_source(self.tokenizer),
                    n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_ids),
                )
            return self._index

    def _worker_source(self) -> tuple[Any, int, list[int]]:
        """What a worker builds the same tokenizer index from (picklable, no torch)."""
        backend = self.tokenizer.backend
        source: Any
        if isinstance(backend, SpmVocab):
            spm = _SpmTokens(self.tokenizer, backend)
            source = {
                "tokens": spm.tokens,
                "eos_token_id": spm.eos_token_id,
                "bos_token_id": spm.bos_token_id,
                "special_token_ids": spm.special_token_ids,
            }
        else:
            source = backend.to_str()
        return source, self.vocab_size, list(self.tokenizer.eos_ids)


def schema_text(schema: Mapping[str, Any] | None) -> str:
    """The text of ``schema`` (None: any JSON object) that is compiled, and the key of its
    grammar. Keys keep their order: the grammar writes properties in the schema's order."""
    return json.dumps({"type": "object"} if schema is None else schema)


def _charge(kept: int, config: GrammarConfig) -> int:
    """What a grammar is charged in the plan: what it keeps once compiled (measured in its
    worker) and what its lexer may still add."""
    return kept + config.lexer_bytes


def _admits_output(matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> bool:
    """Whether a fresh matcher allows some token other than end-of-sequence first."""
    if matcher.is_error() or matcher.is_stopped():
        return False
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    allowed[[e for e in eos_ids if e < vocab_size]] = 0
    return bool(allowed.any())


def _forced_failure(matcher: Any) -> str | None:
    """Why the grammar engine cannot follow the tokens every document starts with (a
    parser limit reached at once, as an object of thousands of properties reaches it);
    None if it can. Consumes them from ``matcher``."""
    forced = matcher.compute_ff_tokens()
    if (forced and not matcher.consume_tokens(forced)) or matcher.is_error():
        return (
            f"the grammar engine cannot follow it past its first {len(forced)} tokens "
            f"({_first_line(matcher.get_error())}); simplify the schema (fewer properties or "
            "alternatives)"
        )
    return None


# --- schemas the grammar cannot enforce -------------------------------------------------

# Keywords whose subschemas apply to the same instance (no property or item entered), each
# with how its value holds them.
_IN_PLACE = {"allOf": "list", "anyOf": "list", "oneOf": "list", "not": "one", "if": "one",
             "then": "one", "else": "one", "dependentSchemas": "dict"}  # fmt: skip
# Keywords whose subschemas apply to a property or an item of the instance.
_INSIDE = {"properties": "dict", "patternProperties": "dict", "additionalProperties": "one",
           "items": "one-or-list", "prefixItems": "list", "additionalItems": "one",
           "contains": "one", "propertyNames": "one", "unevaluatedItems": "one",
           "unevaluatedProperties": "one", "$defs": "dict", "definitions": "dict"}  # fmt: skip


def check_schema(schema: Any) -> None:
    """Refuse what the grammar would half-enforce: a ``$ref`` loop that enters no property
    or array item (``{"$ref": "#"}``, mutual references, ``allOf``/``anyOf`` of a reference
    to itself: no finite document follows it), and a chain of more than `MAX_REF_CHAIN`
    references, and an integer past +-2**53 in a literal or a bound (`MAX_EXACT_INTEGER`).
    Raises `GrammarError` naming the loop, the chain or the integer's pointer."""
    if not isinstance(schema, Mapping):
        return
    # pointer → (pointer, 1 for a $ref hop, 0 for a subschema) applied to the same instance
    edges: dict[str, list[tuple[str, int]]] = {}
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        pointer, node = stack.pop()
        if pointer in edges or not isinstance(node, Mapping):
            continue
        here = edges[pointer] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = _resolve(schema, ref)
            if target is not None:
                here.append((target[0], 1))
                stack.append(target)
        for key, value in node.items():
            if key in _LITERAL_KEYWORDS:
                _check_exact_integers(f"{pointer}/{_escape(str(key))}", value)
            shape = _IN_PLACE.get(key) or _INSIDE.get(key)
            if shape is None:
                continue
            for child in _children(f"{pointer}/{_escape(str(key))}", value, shape):
                stack.append(child)
                if key in _IN_PLACE:
                    here.append((child[0], 0))
    _check_loops(edges)
    _check_chain(edges)


# Keywords whose values are literal JSON (or bounds) the grammar compiles as numbers.
_LITERAL_KEYWORDS = frozenset(
    {"const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
# llguidance reads a schema's numbers as doubles: an integer past 2**53 would be enforced as
# its nearest double (found by the property test: enum [9007199254740993] let the output
# 9007199254740992 through), so such a schema is refused rather than half-enforced.
MAX_EXACT_INTEGER = 2**53


def _check_exact_integers(pointer: str, value: Any) -> None:
    stack: list[tuple[str, Any]] = [(pointer, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_EXACT_INTEGER:
            raise GrammarError(
                f"JSON schema at {where}: the integer {item} is past +-2**53 "
                f"({MAX_EXACT_INTEGER}), which the grammar cannot enforce exactly; "
                "send it as a string, or use a smaller value"
            )
        if isinstance(item, Mapping):
            stack.extend((f"{where}/{_escape(str(k))}", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}/{i}", v) for i, v in enumerate(item))


def _children(pointer: str, value: Any, shape: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and shape == "dict":
        for name, child in value.items():
            yield f"{pointer}/{_escape(str(name))}", child
    elif isinstance(value, list) and shape in ("list", "one-or-list"):
        for index, child in enumerate(value):
            yield f"{pointer}/{index}", child
    elif isinstance(value, Mapping) and shape in ("one", "one-or-list"):
        yield pointer, value


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(schema: Mapping[str, Any], ref: str) -> tuple[str, Any] | None:
    """The canonical pointer and the subschema of a local ``$ref`` ("#", "#/$defs/a"); None
    if it names none (an anchor, a missing path: llguidance then says why)."""
    path = unquote(ref[1:])
    if path and not path.startswith("/"):
        return None
    node: Any = schema
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    for part in parts:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return "#" + "".join(f"/{_escape(p)}" for p in parts), node


def _check_loops(edges: dict[str, list[tuple[str, int]]]) -> None:
    """A cycle of in-place edges is a loop no document can leave. Depth-first, without
    recursion (a chain may be thousands long)."""
    done: set[str] = set()
    for root in edges:
        if root in done:
            continue
        on_path = {root: 0}
        path: list[tuple[str, Iterator[tuple[str, int]]]] = [(root, iter(edges[root]))]
        while path:
            node, todo = path[-1]
            step = next(todo, None)
            if step is None:
                path.pop()
                del on_path[node]
                done.add(node)
                continue
            child = step[0]
            if child in on_path:
                loop = [p for p, _ in path[on_path[child] :]] + [child]
                raise GrammarError(
                    "the JSON schema refers to itself without entering a property or an "
                    "array item (" + " → ".join(loop) + "): the grammar cannot enforce such a "
                    "loop, and without another branch no document satisfies it; make the "
                    "recursion go through a property or an array item"
                )
            if child not in done and child in edges:
                on_path[child] = len(path)
                path.append((child, iter(edges[child])))


def _check_chain(edges: dict[str, list[tuple[str, int]]]) -> None:
    """The longest run of ``$ref`` hops applied to one instance (the graph has no loop)."""
    hops: dict[str, int] = {}
    for root in edges:
        stack = [root]
        while stack:
            node = stack[-1]
            if node in hops:
                stack.pop()
                continue
            pending = [c for c, _ in edges.get(node, ()) if c not in hops]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            hops[node] = max((hops[c] + w for c, w in edges.get(node, ())), default=0)
            if hops[node] > MAX_REF_CHAIN:
                raise GrammarError(
                    f"the JSON schema's $ref chain from {node} is {hops[node]} references "
                    f"long, more than the {MAX_REF_CHAIN} this server follows; inline some "
                    "of the definitions"
                )


# --- the bounded, cancellable pool ------------------------------------------------------


class CompileJob:
    """One schema in the compile pool. ``future`` gives its `Grammar` or raises; `cancel`
    stops it wherever it is (a worker compiling it is killed); `expire` gives up on it if
    no worker took it yet."""

    def __init__(
        self, text: str, queue_timeout_s: float, reserve: Callable[[int], None] | None = None
    ) -> None:
        self.text = text
        self.queue_timeout_s = queue_timeout_s
        self.deadline = time.monotonic() + queue_timeout_s
        self.reserve = reserve
        self.future: concurrent.futures.Future[Grammar] = concurrent.futures.Future()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        self.future.cancel()

    def expire(self) -> bool:
        """Give up on a job still queued: True (its future then raises `GrammarBusy`);
        False once a worker has it (it ends within the compile's own bounds)."""
        if self.future.cancel():
            return True
        return self.future.cancelled()

    def result(self, timeout: float | None = None) -> Grammar:
        """Wait for the grammar: at most until the queue's deadline for a worker, then as
        long as the compile's bounds allow."""
        wait = max(self.deadline - time.monotonic(), 0.0)
        try:
            return self.future.result(timeout=wait if timeout is None else min(wait, timeout))
        except concurrent.futures.TimeoutError:
            if self.expire():
                raise GrammarBusy(self.busy_message()) from None
        return self.future.result(timeout=timeout)

    def busy_message(self) -> str:
        return (
            f"no grammar compile slot came free within --grammar-queue-timeout "
            f"{self.queue_timeout_s:g} s (other schemas are compiling); retry later, or raise "
            "--grammar-workers or --grammar-queue-timeout"
        )


class _CompilePool:
    """`GrammarConfig.workers` threads, each with one worker process, taking jobs in order
    from one queue. Daemon threads: nothing waits for them at exit, and the workers die
    with this process (PR_SET_PDEATHSIG)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.config = compiler.config
        self.jobs: queue.Queue[CompileJob | None] = queue.Queue()
        self.closed = threading.Event()
        self.workers: list[_Worker | None] = [None] * self.config.workers
        self.running: list[CompileJob | None] = [None] * self.config.workers
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._run, args=(i,), name=f"slotserve-grammar-{i}", daemon=True
            )
            for i in range(self.config.workers)
        ]
        for thread in self.threads:
            thread.start()

    def put(self, job: CompileJob) -> None:
        if self.closed.is_set():
            job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))
            return
        self.jobs.put(job)

    def close(self) -> None:
        self.closed.set()
        for _ in self.threads:
            self.jobs.put(None)
        with self._lock:
            workers, self.workers = self.workers, [None] * len(self.workers)
            for job in self.running:
                if job is not None:
                    job.cancelled.set()
        for worker in workers:
            if worker is not None:
                worker.kill()
        while True:  # what was still queued
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))

    def _run(self, slot: int) -> None:
        _lower_priority()
        while True:
            job = self.jobs.get()
            if job is None or self.closed.is_set():
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))
                return
            if time.monotonic() > job.deadline:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(GrammarBusy(job.busy_message()))
                continue
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled or expired while queued
            with self._lock:
                self.running[slot] = job
            try:
                job.future.set_result(self._compile(slot, job))
            except BaseException as exc:  # every outcome goes to the waiter
                job.future.set_exception(exc)
            finally:
                with self._lock:
                    self.running[slot] = None
            del job  # waiting for the next one must not keep this one's grammar alive

    def _worker(self, slot: int) -> _Worker:
        with self._lock:
            worker = self.workers[slot]
            if worker is None or not worker.alive:
                worker = _Worker(self.compiler._worker_source())
                self.workers[slot] = worker
        return worker

    def _drop(self, slot: int, worker: _Worker) -> None:
        worker.dispose()
        with self._lock:
            if self.workers[slot] is worker:
                self.workers[slot] = None

    def _compile(self, slot: int, job: CompileJob) -> Grammar:
        config = self.config
        worker = self._worker(slot)
        try:
            kept = worker.compile(job, config)
        except BaseException:
            self._drop(slot, worker)
            raise
        charge = _charge(kept, config)
        if charge > config.max_bytes:
            raise GrammarLimitError(
                f"its grammar keeps {kept / _MIB:.1f} MiB, and with the "
                f"{config.lexer_bytes / _MIB:.0f} MiB its lexer may add that is more than "
                f"one grammar's share, --grammar-max-bytes {config.max_bytes / _MIB:.0f} MiB; "
                "simplify the schema or raise --grammar-max-bytes",
                "memory",
                config.max_bytes,
            )
        if job.reserve is not None:
            job.reserve(charge)
        if job.cancelled.is_set():
            raise GrammarCancelled("the compile was cancelled")
        # Proven bounded in the worker: this compile takes what that one took.
        return self.compiler._compile_schema(job.text, charge)


def _lower_priority() -> None:
    """This thread at the lowest CPU priority (Linux: nice is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _Worker:
    """One worker process: a Python that imports llguidance only (no torch), builds the
    tokenizer index once, then compiles one schema at a time and reports what the grammar
    keeps (malloc's bytes in use). Killed on any bound, cancellation or close."""

    def __init__(self, source: tuple[Any, int, list[int]]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", _WORKER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the server's to handle
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        self._send(source)
        reply = self._receive()
        if reply != ("ready",):
            self.dispose()
            raise GrammarError(f"the grammar worker did not start: {reply!r}")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Kill the process (any thread; a compile reading from it then sees it end)."""
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def dispose(self) -> None:
        """`kill`, and close its pipes (only the thread that compiles with it)."""
        self.kill()
        for stream in (self._in, self._out):
            with contextlib.suppress(OSError):
                stream.close()

    def compile(self, job: CompileJob, config: GrammarConfig) -> int:
        """The bytes the grammar of ``job`` keeps; raises `GrammarError` for a schema
        llguidance refuses, `GrammarLimitError` past a bound, `GrammarCancelled`."""
        baseline = rss_bytes(self.process.pid)
        try:
            self._send((job.text, _JSON_OPTIONS, config.limits()))
        except OSError:  # the worker was killed before it had the schema (a broken pipe)
            if job.cancelled.is_set():  # by close() or a cancel
                raise GrammarCancelled("the compile was cancelled") from None
            raise
        start = time.monotonic()
        peak = 0
        while True:
            ready, _, _ = select.select([self._out], [], [], POLL_S)
            if ready:
                try:
                    reply = self._receive()
                except GrammarError:
                    if job.cancelled.is_set():  # killed by close()
                        raise GrammarCancelled("the compile was cancelled") from None
                    raise
                break
            if job.cancelled.is_set():
                raise GrammarCancelled("the compile was cancelled")
            elapsed = time.monotonic() - start
            if elapsed > config.timeout_s:
                raise GrammarLimitError(
                    f"it did not compile within --grammar-timeout {config.timeout_s:g} s "
                    "(stopped); simplify the schema (fewer combined patterns or alternatives) "
                    "or raise --grammar-timeout",
                    "timeout",
                    config.timeout_s,
                )
            grown = rss_bytes(self.process.pid) - baseline
            peak = max(peak, grown)
            if grown > config.max_bytes:
                raise GrammarLimitError(
                    f"compiling it took more than --grammar-max-bytes "
                    f"{config.max_bytes / _MIB:.0f} MiB (stopped at {grown / _MIB:.0f} MiB after "
                    f"{elapsed:.1f} s); simplify the schema or raise --grammar-max-bytes",
                    "memory",
                    config.max_bytes,
                )
        kind = reply[0]
        if kind == "ok":
            return int(reply[1])
        if kind == "empty":
            raise GrammarError(
                "JSON schema: it admits no document at all (no first token is allowed): give "
                "every $ref loop a way out, or remove the contradictory keywords"
            )
        if kind == "schema":
            raise GrammarError(f"the JSON schema is not usable: {reply[1]}")
        raise GrammarError(f"JSON schema: {_first_line(str(reply[1]))}")

    def _send(self, message: Any) -> None:
        data = pickle.dumps(message)
        self._in.write(struct.pack("<I", len(data)) + data)
        self._in.flush()

    def _receive(self) -> Any:
        head = self._out.read(4)
        if len(head) < 4:
            code = self.process.wait()
            raise GrammarError(f"the grammar worker died compiling it (exit status {code})")
        (size,) = struct.unpack("<I", head)
        return pickle.loads(self._out.read(size))


# The worker's program: its own interpreter (-I), importing llguidance alone. Frames are a
# little-endian u32 length and a pickle, both ways; the parent is the only peer.
_WORKER_CODE = r"""
import ctypes, os, pickle, signal, struct, sys
try:
    os.nice(19)
except OSError:
    pass
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
except Exception:
    pass
read, write = sys.stdin.buffer, sys.stdout.buffer

def receive():
    head = read.read(4)
    if len(head) < 4:
        sys.exit(0)
    return pickle.loads(read.read(struct.unpack("<I", head)[0]))

def send(message):
    data = pickle.dumps(message)
    write.write(struct.pack("<I", len(data)) + data)
    write.flush()

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]

try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
except Exception:
    def in_use():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

import llguidance

class Tokens:
    def __init__(self, source):
        self.tokens = source["tokens"]
        self.eos_token_id = source["eos_token_id"]
        self.bos_token_id = source["bos_token_id"]
        self.special_token_ids = source["special_token_ids"]
    def __call__(self, text):
        return []  # compiling never encodes text

source, n_vocab, eos = receive()
if isinstance(source, dict):
    source = llguidance.TokenizerWrapper(Tokens(source))
index = llguidance.LLTokenizer(source, n_vocab=n_vocab, eos_token=eos)
send(("ready",))
while True:
    text, options, limits = receive()
    before = in_use()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
    except ValueError as exc:
        send(("schema", str(exc)))
        continue
    matcher = llguidance.LLMatcher(
        index, grammar, log_level=0, limits=llguidance.LLParserLimits(**limits)
    )
    if matcher.is_error():
        send(("error", matcher.get_error()))
        continue
    start = matcher.deep_copy()
    bits = int.from_bytes(start.compute_bitmask(), "little")
    allowed = bin(bits).count("1") - sum(bits >> e & 1 for e in set(eos))
    if start.is_error() or allowed <= 0:
        send(("empty",))
        continue
    forced = start.compute_ff_tokens()
    if (forced and not start.consume_tokens(forced)) or start.is_error():
        send(("error", "the grammar engine cannot follow it past its first %d tokens (%s); "
              "simplify the schema (fewer properties or alternatives)"
              % (len(forced), start.get_error().strip().splitlines()[0])))
        continue
    del start
    send(("ok", max(in_use() - before, 0)))
    del matcher
"""


def _llguidance_source(tokenizer: Tokenizer) -> Any:
    """What llguidance reads a tokenizer from: a Hugging Face backend's JSON, or for a
    SentencePiece vocabulary (which `tokenizers` cannot express) each token's bytes, the
    special ids and the encoder, as a `llguidance.TokenizerWrapper`."""
    import llguidance

    backend = tokenizer.backend
    if not isinstance(backend, SpmVocab):
        return backend.to_str()
    return llguidance.TokenizerWrapper(_SpmTokens(tokenizer, backend))


class _SpmTokens:
    """The attributes `llguidance.TokenizerWrapper` reads, over an `SpmVocab`."""

    def __init__(self, tokenizer: Tokenizer, vocab: SpmVocab) -> None:
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [vocab.piece(i) for i in range(vocab.vocab_size)]
        self.special_token_ids = sorted(vocab.special_ids)
        self._vocab = vocab

    def __call__(self, text: bytes) -> list[int]:
        return self._vocab.encode(text.decode("utf-8", "replace"), parse_special=False)


class Grammar:
    """A compiled token grammar for one tokenizer and logits width: which tokens may come
    next. Immutable and shared by the requests that use it; each request advances a
    `GrammarMatcher` of its own (`matcher`). Made by `GrammarCompiler`; ``nbytes`` is what
    it is charged in the memory plan (0 when compiled unmeasured).

    Built with llguidance (the grammar engine of llama.cpp and vLLM): its per-token mask
    costs tens of microseconds on a 49k vocabulary, and it names the JSON Schema keywords
    it does not implement instead of ignoring them.
    """

    def __init__(
        self,
        template: Any,
        vocab_size: int,
        eos_ids: Sequence[int],
        description: str,
        nbytes: int = 0,
    ) -> None:
        self.description = description
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.nbytes = nbytes
        self._template = template  # llguidance.LLMatcher at the start of the grammar
        self._lock = threading.Lock()  # matchers are copied from any submitting thread

    def matcher(self, vocab_size: int) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, for a request whose logits have
        ``vocab_size`` columns (which must be the grammar's)."""
        if vocab_size != self.vocab_size:
            raise ValueError(
                f"grammar built for {self.vocab_size} logits, the model has {vocab_size}: "
                "build it with the model's info.vocab_size"
            )
        with self._lock:
            matcher = self._template.deep_copy()
        return GrammarMatcher(matcher, vocab_size, self.eos_ids)

    def refusal(self, tokens: Sequence[int]) -> str | None:
        """Why ``tokens`` (an output, its end-of-sequence token included or not) is not a
        complete document of this grammar; None when it is. A request whose matcher went
        into error (a limit reached mid-document) was ended with end-of-sequence, and its
        output must not be reported as a finished document."""
        body = list(tokens)
        while body and body[-1] in self.eos_ids:
            body.pop()
        with self._lock:
            matcher = self._template.deep_copy()
        for index, token in enumerate(body):
            if not matcher.consume_token(token):
                reason = _first_line(matcher.get_error()) if matcher.is_error() else "refused"
                return f"token {index} of {len(body)} was not allowed ({reason})"
        if not matcher.is_accepting():
            return f"the document is incomplete after {len(body)} tokens"
        return None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


class GrammarMatcher:
    """One request's place in a `Grammar`: the mask of allowed next tokens, advanced by
    each token the request produces. Buffers are allocated once, not per step."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._blocked = torch.empty(vocab_size, dtype=torch.bool)
        self._eos = torch.tensor(list(eos_ids), dtype=torch.long)
        self._warned = False

    def allowed(self) -> torch.Tensor:
        """``bool[vocab]``: the tokens the grammar allows next (end-of-sequence tokens once
        the grammar is complete)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        # Bit i of 32-bit word w is token 32*w + i; on a little-endian host the words'
        # bytes unpack in that order.
        bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].view(np.bool_))

    def restrict(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids to -inf, in place."""
        allowed = self.allowed()
        if not allowed.numpy().any():  # a matcher in error: end the request, never draw junk
            allowed[self._eos] = True
        if numpy_view_ok(logits):
            # numpy, single-threaded (see `slotserve.sampling.cpu`).
            np.logical_not(allowed.numpy(), out=self._blocked.numpy())
            np.putmask(logits.numpy(), self._blocked.numpy(), -np.inf)
        else:
            torch.logical_not(allowed, out=self._blocked)
            logits.masked_fill_(self._blocked, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token``. A token the grammar forbids (only possible when the
        caller drew without the mask) leaves the matcher in error: only end-of-sequence
        is allowed from then on, so the request ends."""
        if not self._matcher.consume_token(token) and not self._warned:
            self._warned = True
            log.warning("grammar refused token %d: %s", token, self.error)

    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is a complete match (it may still go on)."""
        return bool(self._matcher.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Whether the grammar allows nothing more but end-of-sequence."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else None
