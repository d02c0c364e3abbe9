"""Grammar constraints (structured outputs) with llguidance: `GrammarCompiler` turns a JSON
schema into a `Grammar` for one tokenizer and logits width, and each request advances a
`GrammarMatcher` of its own that masks the tokens the grammar forbids.

Two ways to compile. `GrammarCompiler.json_schema` and `compile` compile in the calling
thread, for schemas and grammars the caller trusts (benches, tests, library code).
`GrammarCompiler.submit` and `submit_grammar` are for what comes from the network: they go
through the bounded pool of worker processes (compile_pool.py), killed past the time and
memory bounds of `GrammarConfig` (grammar_config.py, with the errors both modules raise).

Owns llguidance's objects; knows nothing of sampling parameters or the batch. Module state:
none (the tokenizer index and the pool live in the compiler its owner keeps).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import numpy as np
import torch

from slotserve.sampling.compile_pool import CompileJob, CompilePool
from slotserve.sampling.cpu import numpy_view_ok
from slotserve.sampling.grammar_config import (
    JSON_OPTIONS,
    GrammarBusy,
    GrammarCancelled,
    GrammarConfig,
    GrammarError,
    GrammarLimitError,
    JobKind,
    first_line,
    grammar_charge,
)
from slotserve.tokenizer import Tokenizer
from slotserve.tokenizer.spm import SpmVocab

log = logging.getLogger("slotserve")

# $ref hops followed without entering a property or an array item (a longer chain is
# refused: it is no grammar's limit, but Python validators recurse once per hop).
MAX_REF_CHAIN = 64

__all__ = [
    "CompileJob",
    "Grammar",
    "GrammarBusy",
    "GrammarCancelled",
    "GrammarCompiler",
    "GrammarConfig",
    "GrammarError",
    "GrammarLimitError",
    "GrammarMatcher",
    "JobKind",
    "check_schema",
    "grammar_text",
    "schema_text",
]


class GrammarCompiler:
    """Compiles grammars for one tokenizer and logits width.

    Owns llguidance's view of the tokenizer, built on the first compile (it walks the whole
    vocabulary, so it costs time and memory in proportion to it; `release` drops it) and
    shared by every
    grammar compiled here, so whoever keeps a model's grammars keeps one compiler per model.
    Any thread may compile: the index is built once, under the compiler's lock. `submit`
    compiles in the bounded pool (`GrammarConfig`), started on its first use; `close` ends
    it.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, config: GrammarConfig | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config or GrammarConfig()
        self._index: Any = None  # llguidance.LLTokenizer, once built
        self._lock = threading.Lock()
        self._pool: CompilePool[Grammar] | None = None
        self._openings: dict[str, int] | None = None  # `_opening_tokens`, once

    def json_schema(self, schema: Mapping[str, Any] | None) -> Grammar:
        """Output that parses as JSON and validates against ``schema``; ``None``: any JSON
        object (OpenAI's ``json_object`` mode). Compiles here, unbounded in time: for
        trusted schemas (see `submit`). Raises `GrammarError` for a schema that uses a
        keyword llguidance does not implement (named), one it cannot enforce, or an invalid
        one."""
        text = schema_text(schema)
        return self._compile_schema(text, grammar_charge(0, self.config))

    def submit(
        self,
        schema: Mapping[str, Any] | None,
        reserve: Callable[[int], None] | None = None,
    ) -> CompileJob[Grammar]:
        """Compile ``schema`` in the bounded pool: a `CompileJob` whose future gives the
        `Grammar`, or raises `GrammarError` (`GrammarLimitError` past a bound of the
        config), `GrammarBusy` (no worker before the queue's deadline) or
        `GrammarCancelled`. ``reserve(nbytes)`` is called once the grammar's size is known,
        before it is built here; it may raise `GrammarError` to refuse it."""
        check_schema(schema)  # cheap, and a refusal needs no worker
        return self._put(
            CompileJob[Grammar](schema_text(schema), self.config.queue_timeout_s, reserve)
        )

    def submit_grammar(
        self,
        grammar: str,
        description: str,
        reserve: Callable[[int], None] | None = None,
        kind: JobKind = "grammar",
    ) -> CompileJob[Grammar]:
        """Compile ``grammar`` in the bounded pool, as `submit` compiles a schema:
        llguidance's grammar text (``kind`` ``"grammar"``, as `compile` takes it), or a GBNF
        grammar or a regular expression (``"gbnf"``, ``"regex"``: `grammar_text`);
        ``description`` names it in errors."""
        job = CompileJob[Grammar](
            grammar, self.config.queue_timeout_s, reserve, kind=kind, description=description
        )
        return self._put(job)

    def compile_source(self, kind: JobKind, text: str, description: str) -> Grammar:
        """`compile` for any kind of grammar text (`grammar_text`), here and unbounded: for
        grammars the caller trusts (tests, benches)."""
        if kind == "schema":
            return self._compile_schema(text, grammar_charge(0, self.config))
        return self.compile(grammar_text(kind, text, description), description)

    def _put(self, job: CompileJob[Grammar]) -> CompileJob[Grammar]:
        with self._lock:
            if self._pool is None:
                self._pool = CompilePool(self.config, self.worker_source, self._finish)
            pool = self._pool
        pool.put(job)
        return job

    def _finish(self, job: CompileJob[Grammar], nbytes: int) -> Grammar:
        """A job its worker proved within the bounds, built here (it takes what it took
        there)."""
        if job.kind == "schema":
            return self._compile_schema(job.text, nbytes)
        return self.compile(
            grammar_text(job.kind, job.text, job.description), job.description, nbytes
        )

    def close(self) -> None:
        """Kill the pool's workers (a compile under way ends with `GrammarCancelled`);
        returns at once. A later `submit` starts a new pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def release(self) -> None:
        """Drop what compiling built once (the tokenizer index, the pool's workers) until the
        next compile builds it again. A server measures that cost at start
        (`slotserve.sampling.grammar_index.prepare`), reserves it in its plan, and then
        releases it: a server that never gets a structured request never holds it."""
        self.close()
        with self._lock:
            self._index = None

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
            raise GrammarError(f"{description}: {first_line(template.get_error())}")
        start = template.deep_copy()
        if not _admits_output(start, self.vocab_size, self.tokenizer.eos_ids):
            raise GrammarError(
                f"{description}: it admits no document at all (no first token is allowed): "
                "give every $ref loop a way out, or remove the contradictory keywords"
            )
        openings = self._opening_tokens()
        failure = _forced_failure(start) or _opening_failure(template, openings, self.vocab_size)
        if failure is not None:
            raise GrammarError(f"{description}: {failure}")
        return Grammar(template, self.vocab_size, self.tokenizer.eos_ids, description, nbytes)

    def _opening_tokens(self) -> dict[str, int]:
        """The tokens that open a JSON object, array or string, where one token is each."""
        if self._openings is None:
            found = {}
            for text in OPENINGS:
                ids = self.tokenizer.encode(text, add_bos=False)
                if len(ids) == 1 and ids[0] < self.vocab_size:
                    found[text] = ids[0]
            self._openings = found
        return self._openings

    def _compile_schema(self, text: str, nbytes: int) -> Grammar:
        import llguidance

        check_schema(json.loads(text))
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text,
                defaults=JSON_OPTIONS,  # type: ignore[arg-type]
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

    def worker_source(self) -> tuple[Any, int, list[int]]:
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


def grammar_text(kind: JobKind, text: str, description: str) -> str:
    """llguidance's grammar text for ``text`` of ``kind``: a GBNF grammar converted to Lark
    (llguidance's own converter; text already in Lark passes through), a regular expression
    as a grammar whose whole output matches it, llguidance's text as it is. Raises
    `GrammarError` naming ``description`` for text that does not convert."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if kind == "gbnf":
            return any_to_lark(text)
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(text))
    except (Exception, RecursionError) as exc:
        raise GrammarError(f"{description}: {first_line(str(exc) or type(exc).__name__)}") from None
    return text


def schema_text(schema: Mapping[str, Any] | None) -> str:
    """The text of ``schema`` (None: any JSON object) that is compiled, and the key of its
    grammar. Keys keep their order: the grammar writes properties in the schema's order."""
    return json.dumps({"type": "object"} if schema is None else schema)


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
            f"({first_line(matcher.get_error())}); simplify the schema (fewer properties or "
            "alternatives)"
        )
    return None


# What `_opening_failure` tries a document's first value with.
OPENINGS = ("{", "[", '"')


def _opening_failure(template: Any, openings: Mapping[str, int], vocab_size: int) -> str | None:
    """Why the grammar engine cannot follow a document whose first value opens with one of
    ``openings`` (text to token id) that the grammar allows there, then the tokens forced
    after it: a parser limit reached one token in (an ``anyOf`` whose object branch has
    hundreds of properties reaches it once ``{`` is chosen, where nothing was forced
    before it). None if it can follow each. Changes nothing in ``template``. Deeper limits
    remain possible: output that ends there is refused (`Grammar.refusal`)."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    template.deep_copy().unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    for text, token in openings.items():
        if not words[token // 32] >> (token % 32) & 1:
            continue  # the grammar does not open with it
        matcher = template.deep_copy()
        if matcher.consume_token(token):  # a refusal of an allowed token is the limit
            forced = matcher.compute_ff_tokens()
            if not matcher.is_error() and (not forced or matcher.consume_tokens(forced)):
                # the next mask is not wanted: computing it is the step that may fail
                after = np.zeros_like(words)
                matcher.unsafe_compute_mask_ptr(after.ctypes.data, after.nbytes)
        if matcher.is_error():
            return (
                f"the grammar engine cannot follow a document that opens with {text!r} "
                f"({first_line(matcher.get_error())}); simplify the schema (fewer properties "
                "or alternatives)"
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
                reason = first_line(matcher.get_error()) if matcher.is_error() else "refused"
                return f"token {index} of {len(body)} was not allowed ({reason})"
        if not matcher.is_accepting():
            return f"the document is incomplete after {len(body)} tokens"
        return None


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
        return first_line(self._matcher.get_error()) if self._matcher.is_error() else None
