"""Sampling: `SamplingParams`, a per-request seeded sampler, a batched entry point, and
stop-string matching that never emits part of a stop string.

The sampler is a chain of small logit transforms (penalties → temperature → top-k →
top-p → min-p → draw), each a function of its inputs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5


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
    """Sampling state of one request: its RNG and the token counts penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt: Sequence[int] = ()):
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.generated_counts = torch.zeros(vocab_size, dtype=torch.float32)
        if prompt:
            self.seen[torch.tensor(list(prompt))] = True

    def accept(self, token: int) -> None:
        """Record a token the request produced (feeds the penalties)."""
        self.seen[token] = True
        self.generated_counts[token] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from ``logits[vocab]``."""
        params = self.params
        if params.has_penalties:
            logits = apply_penalties(logits, params, self.seen, self.generated_counts)
        if params.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.double() / params.temperature, dim=-1)
        probs = filter_probs(probs, params)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(logits.argmax())  # degenerate distribution (e.g. inf logits): greedy
        return int(torch.multinomial(probs, 1, generator=self.generator))


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
    """One token per row of ``logits[B, vocab]``; all-greedy batches take one argmax."""
    if all(s.params.greedy and not s.params.has_penalties for s in samplers):
        tokens: list[int] = logits.argmax(-1).tolist()
    else:
        tokens = [s.sample(row) for s, row in zip(samplers, logits, strict=True)]
    for sampler, token in zip(samplers, tokens, strict=True):
        sampler.accept(token)
    return tokens


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
