"""Sampling: `SamplingParams`, a per-request seeded sampler, a batched entry point, grammar
constraints (`Grammar`, llguidance), and stop-string matching that never emits part of a
stop string.

The sampler is a chain of small logit transforms (logit bias → grammar mask → penalties →
temperature → top-k → top-p → min-p → draw), each a function of its inputs. Bias and mask
are per request, applied row by row inside the batched sampler, so constrained and free
requests share a batch step.
"""

from __future__ import annotations

import logging
import random
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slotserve.tokenizer import Tokenizer

log = logging.getLogger("slotserve")

MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy.

    ``seed`` makes sampling reproducible per request (the same seed gives the same tokens
    whatever else is running). ``stop`` strings end generation and are never emitted.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's and the top k
    # (token id, bias) pairs added to the logits, as OpenAI's logit_bias (-100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only tokens this grammar allows next may be drawn (structured outputs).
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        _check(0.0 <= self.temperature <= 100.0, "temperature", self.temperature, "0..100")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 disables)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "-2..2"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "-2..2",
        )
        _check(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens, ">= 0")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", self.logprobs, "0..20")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", self.seed, "a 64-bit integer")
        if isinstance(self.stop, str) or any(not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        for token, bias in self.logit_bias:
            _check(token >= 0, "logit_bias token id", token, ">= 0")
            _check(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias", bias, "-100..100")

    @property
    def greedy(self) -> bool:
        # Temperatures this small make every distribution one-hot (and overflow the
        # division), so they are greedy.
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


class RequestSampler:
    """Sampling state of one request: its RNG, the token counts penalties need, its logit
    bias and its grammar matcher (which advances with every token the request produces).

    Used by one thread at a time (the engine thread, once the request runs)."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt: Sequence[int] = ()):
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.generated_counts = torch.zeros(vocab_size, dtype=torch.float32)
        if prompt:
            self.seen[torch.tensor(list(prompt))] = True
        self.bias = _bias_tensors(params.logit_bias, vocab_size)
        self.matcher = params.grammar.matcher(vocab_size) if params.grammar is not None else None

    @property
    def restricts(self) -> bool:
        """Whether this request changes its logits before drawing (bias or grammar)."""
        return self.bias is not None or self.matcher is not None

    def restrict(self, logits: torch.Tensor) -> None:
        """Add the logit bias to ``logits[vocab]`` and mask what the grammar forbids, in
        place (the caller owns the row)."""
        if self.bias is not None:
            ids, values = self.bias
            logits.index_add_(0, ids, values)
        if self.matcher is not None:
            self.matcher.restrict(logits)

    def accept(self, token: int) -> None:
        """Record a token the request produced (feeds the penalties and the grammar)."""
        self.seen[token] = True
        self.generated_counts[token] += 1
        if self.matcher is not None:
            self.matcher.accept(token)

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from ``logits[vocab]`` (bias and grammar applied here)."""
        if self.restricts:
            logits = logits.clone()
            self.restrict(logits)
        return self.draw(logits)

    def draw(self, logits: torch.Tensor) -> int:
        """Pick the next token from ``logits[vocab]`` that bias and grammar already shaped."""
        params = self.params
        if params.has_penalties:
            logits = apply_penalties(logits, params, self.seen, self.generated_counts)
        if params.greedy:
            return int(logits.argmax())
        values, candidates = logits, None
        if params.top_k and params.top_k < logits.shape[-1]:
            # Top-k first, on the raw logits (temperature keeps their order): the double
            # conversion, softmax, top-p and min-p then handle k values, not the vocabulary
            # (with the default top_k 40 on a 49k vocabulary, well under a millisecond
            # instead of several). Same result: the filters renormalise over what top-k keeps.
            values, candidates = torch.topk(logits, params.top_k)
        probs = filter_probs(torch.softmax(values.double() / params.temperature, dim=-1), params)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(logits.argmax())  # degenerate distribution (e.g. inf logits): greedy
        index = int(torch.multinomial(probs, 1, generator=self.generator))
        return index if candidates is None else int(candidates[index])


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Repetition penalty (HF rule: over prompt and output) then OpenAI's presence and
    frequency penalties (over output only)."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude (the top token always survives)."""
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = torch.where(before < params.top_p * probs.sum(), sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def token_logprobs(
    logits: torch.Tensor, token: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of ``token`` and its ``top`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    pairs = (
        () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return float(logprobs[token]), pairs


def sample_batch(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """One token per row of ``logits[B, vocab]``; all-greedy batches take one argmax.

    Each request's bias and grammar mask shape its own row only (on a copy: the caller's
    logits stay as the model gave them), so constrained and free requests share a batch."""
    if any(s.restricts for s in samplers):
        logits = _private_copy(logits)
        for sampler, row in zip(samplers, logits, strict=True):
            if sampler.restricts:
                sampler.restrict(row)
    if all(s.params.greedy and not s.params.has_penalties for s in samplers):
        tokens: list[int] = logits.argmax(-1).tolist()
    else:
        tokens = [s.draw(row) for s, row in zip(samplers, logits, strict=True)]
    for sampler, token in zip(samplers, tokens, strict=True):
        sampler.accept(token)
    return tokens


def _bias_tensors(
    logit_bias: Sequence[tuple[int, float]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``logit_bias`` as (ids, values) tensors for ``index_add_``; None when empty."""
    if not logit_bias:
        return None
    ids = [token for token, _ in logit_bias]
    bad = [token for token in ids if not 0 <= token < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias token id {bad[0]} is not in this model's vocabulary (0..{vocab_size - 1})"
        )
    values = [bias for _, bias in logit_bias]
    return torch.tensor(ids), torch.tensor(values, dtype=torch.float32)


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding: invalid, or using a
    feature the grammar engine does not implement (the message names it)."""


# JSON output uses fixed separators and no other whitespace: a small model offered free
# whitespace can emit newlines until its budget runs out, and compact output stays short.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, Any]] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of ``tokenizer`` over ``vocab_size`` logits; built once per
    tokenizer (it walks the whole vocabulary: ~0.2 s for 49k tokens) and shared."""
    import llguidance

    with _TOKENIZERS_LOCK:
        by_size = _TOKENIZERS.setdefault(tokenizer, {})
        if vocab_size not in by_size:
            by_size[vocab_size] = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_ids)
            )
        return by_size[vocab_size]


class Grammar:
    """A compiled token grammar for one tokenizer and logits width: which tokens may come
    next. Immutable and shared by the requests that use it; each request advances a
    `GrammarMatcher` of its own (`matcher`).

    Built with llguidance (the grammar engine of llama.cpp and vLLM): its per-token mask
    costs tens of microseconds on a 49k vocabulary, and it names the JSON Schema keywords
    it does not implement instead of ignoring them.
    """

    def __init__(
        self, grammar: str, tokenizer: Tokenizer, vocab_size: int, description: str
    ) -> None:
        import llguidance

        self.description = description
        self.vocab_size = vocab_size
        self.eos_ids = tuple(tokenizer.eos_ids)
        # log_level=0: a request's grammar failure is reported through GrammarError or our
        # own log, not printed by the library.
        template = llguidance.LLMatcher(
            _grammar_tokenizer(tokenizer, vocab_size), grammar, log_level=0
        )
        if template.is_error():
            raise GrammarError(f"{description}: {_first_line(template.get_error())}")
        self._template = template
        self._lock = threading.Lock()  # matchers are copied from any submitting thread

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | None, tokenizer: Tokenizer, vocab_size: int
    ) -> Grammar:
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
        return cls(grammar, tokenizer, vocab_size, "JSON schema")

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
        if _numpy_view_ok(logits):
            # numpy, single-threaded: one row is too little work to split across torch's
            # intra-op threads, and on a busy device waking them costs milliseconds.
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


def _numpy_view_ok(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.numpy()`` shares its memory (CPU, dense, no autograd)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad


def _private_copy(logits: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` the sampler may change; a single-threaded memcpy on the CPU
    (see `GrammarMatcher.restrict` for why not torch's threaded clone)."""
    if _numpy_view_ok(logits):
        return torch.from_numpy(logits.numpy().copy())
    return logits.clone()


class StopMatcher:
    """Streams text through, holding back any tail that could still become a stop string.

    ``push(text)`` returns the text that is safe to emit and whether a stop string has
    completed (text from the stop string on is dropped).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out, True
        keep = self._held_tail()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        """Text held back when generation ends for another reason."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
