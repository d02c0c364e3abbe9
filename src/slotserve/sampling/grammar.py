"""Grammar constraints (structured outputs) with llguidance: `GrammarCompiler` turns a JSON
schema into a `Grammar` for one tokenizer and logits width, and each request advances a
`GrammarMatcher` of its own that masks the tokens the grammar forbids.

Owns llguidance's objects; knows nothing of sampling parameters or the batch. Module state:
none (the tokenizer index lives in the compiler its owner keeps).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from slotserve.sampling.cpu import numpy_view_ok
from slotserve.tokenizer import Tokenizer
from slotserve.tokenizer.spm import SpmVocab

log = logging.getLogger("slotserve")

# JSON output uses fixed separators and no other whitespace: a small model offered free
# whitespace can emit newlines until its budget runs out, and compact output stays short.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding: invalid, or using a
    feature the grammar engine does not implement (the message names it)."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer and logits width.

    Owns llguidance's view of the tokenizer, built on the first compile (it walks the whole
    vocabulary: ~0.2 s for 49k tokens) and shared by every grammar compiled here, so whoever
    keeps a model's grammars keeps one compiler per model. Any thread may compile: the index
    is built once, under the compiler's lock.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._index: Any = None  # llguidance.LLTokenizer, once built
        self._lock = threading.Lock()

    def json_schema(self, schema: Mapping[str, Any] | None) -> Grammar:
        """Output that parses as JSON and validates against ``schema``; ``None``: any JSON
        object (OpenAI's ``json_object`` mode). Raises `GrammarError` for a schema that
        uses a keyword llguidance does not implement (named), or an invalid one."""
        import llguidance

        if schema is None:
            schema = {"type": "object"}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                dict(schema),
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not usable: {exc}") from None
        return self.compile(grammar, "JSON schema")

    def compile(self, grammar: str, description: str) -> Grammar:
        """``grammar`` (llguidance's grammar text) as a `Grammar`; ``description`` names it
        in errors. Raises `GrammarError` for a grammar llguidance rejects."""
        import llguidance

        # log_level=0: a request's grammar failure is reported through GrammarError or our
        # own log, not printed by the library.
        template = llguidance.LLMatcher(self._tokenizer_index(), grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{description}: {_first_line(template.get_error())}")
        return Grammar(template, self.vocab_size, self.tokenizer.eos_ids, description)

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
    `GrammarMatcher` of its own (`matcher`). Made by `GrammarCompiler`.

    Built with llguidance (the grammar engine of llama.cpp and vLLM): its per-token mask
    costs tens of microseconds on a 49k vocabulary, and it names the JSON Schema keywords
    it does not implement instead of ignoring them.
    """

    def __init__(
        self, template: Any, vocab_size: int, eos_ids: Sequence[int], description: str
    ) -> None:
        self.description = description
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
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
