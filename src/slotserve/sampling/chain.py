"""The samplers llama.cpp's server defines beyond OpenAI's, as pure functions of one row
(and, for the stateful ones, a small state object a `RequestSampler` owns): top-n-sigma,
locally typical sampling, XTC, mirostat (1 and 2) and DRY. Each follows the definition in
llama.cpp's ``src/llama-sampling.cpp`` (its thresholds, its edge cases: what disables it,
what it always keeps), written here on torch tensors; tests/test_samplers.py checks each
against a plain-Python reading of that definition on fixed logits.

Where a sampler reorders or ties, the order here is fixed (stable sorts by index), so a
request's tokens depend only on its own logits, history and seed: never on its batch.
Owns no state of its own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

# llama.cpp's bound on DRY's exponent: base**exponent stays within a float's range.
FLOAT_MAX_LOG = 88.7228391
# Mirostat 1 estimates the distribution's Zipf exponent from this many of its top tokens.
MIROSTAT_M = 100


def top_n_sigma(logits: torch.Tensor, n: float) -> torch.Tensor:
    """Keep the tokens whose logit is within ``n`` standard deviations of the largest
    (mean and deviation over the finite logits); the rest become -inf. ``n <= 0``: all
    kept. Scale invariant, so the same before or after the temperature."""
    finite = torch.isfinite(logits)
    if n <= 0 or int(finite.sum()) <= 1:
        return logits
    values = logits[finite].double()
    floor = float(values.max()) - n * float(values.std(unbiased=False))
    return torch.where(logits.double() < floor, float("-inf"), logits)


def typical(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Locally typical sampling: order the tokens by how far their surprise (-log p) is
    from the distribution's entropy, and keep the closest whose probabilities first add up
    to more than ``p`` (all of them if they never do). ``p >= 1``: all kept. Returns the
    probabilities with the others zeroed (not renormalised)."""
    if p >= 1.0:
        return probs
    live = probs > 0
    dist = probs / probs.sum()
    logp = torch.where(live, torch.log(torch.where(live, dist, 1.0)), 0.0)
    entropy = -(dist * logp).sum()
    shift = torch.where(live, (-logp - entropy).abs(), float("inf"))
    order = torch.argsort(shift, stable=True)
    cumulative = torch.cumsum(dist[order], 0)
    over = torch.nonzero(cumulative > p)
    keep = int(over[0]) + 1 if len(over) else int(live.sum())
    kept = torch.zeros_like(live)
    kept[order[:keep]] = True
    return torch.where(kept & live, probs, 0.0)


def xtc(
    probs: torch.Tensor, threshold: float, probability: float, generator: torch.Generator
) -> torch.Tensor:
    """Exclude Top Choices: with probability ``probability`` (a uniform draw from
    ``generator`` decides, as in llama.cpp only when the sampler is live), drop every token
    at least as likely as ``threshold`` except the least likely of them, so the text leaves
    its most predictable path. Disabled when ``threshold > 0.5`` (one token at most can
    pass it) or fewer than two tokens remain."""
    live = int((probs > 0).sum())
    if probability <= 0 or threshold > 0.5 or live < 2:
        return probs
    if float(torch.rand((), generator=generator, dtype=torch.float64)) > probability:
        return probs
    dist = probs / probs.sum()
    order = torch.argsort(dist, descending=True, stable=True)
    above = int((dist[order] >= threshold).sum())
    if above < 2:  # none, or one: nothing to exclude
        return probs
    excluded = order[: above - 1]
    return probs.index_fill(0, excluded, 0.0)


class Mirostat:
    """Mirostat's state for one request: ``mu``, the surprise ceiling, which starts at
    ``2 * tau`` and follows each draw's observed surprise towards ``tau`` at rate ``eta``.
    Version 2 truncates the tokens whose surprise exceeds ``mu``; version 1 keeps the top
    k, with k estimated from the distribution's Zipf exponent (its ``MIROSTAT_M`` top
    tokens) and ``mu``."""

    def __init__(self, version: int, tau: float, eta: float, vocab_size: int) -> None:
        self.version, self.tau, self.eta, self.vocab_size = version, tau, eta, vocab_size
        self.mu = 2.0 * tau

    def draw(self, probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token from ``probs`` (a distribution over the vocabulary), and update mu."""
        order = torch.argsort(probs, descending=True, stable=True)
        sorted_probs = probs[order].double()
        sorted_probs = sorted_probs / sorted_probs.sum()
        if self.version == 2:  # the tokens before the first whose surprise exceeds mu
            over = torch.nonzero(-torch.log2(sorted_probs) > self.mu)
            keep = max(int(over[0]) if len(over) else len(order), 1)
        else:
            keep = max(self._top_k(sorted_probs), 1)
        kept = sorted_probs[:keep] / sorted_probs[:keep].sum()
        index = int(torch.multinomial(kept, 1, generator=generator))
        observed = -math.log2(float(kept[index]))
        self.mu -= self.eta * (observed - self.tau)
        return int(order[index])

    def _top_k(self, sorted_probs: torch.Tensor) -> int:
        """Mirostat 1's k from the estimated Zipf exponent ``s`` of the top tokens."""
        top = sorted_probs[:MIROSTAT_M].tolist()
        pairs = [
            (math.log((i + 2) / (i + 1)), math.log(top[i] / top[i + 1]))
            for i in range(len(top) - 1)
            if top[i + 1] > 0  # a token the mask removed carries no estimate
        ]
        if not pairs:
            return 1
        s = sum(t * b for t, b in pairs) / sum(t * t for t, _ in pairs)
        epsilon = s - 1
        try:
            k = ((epsilon * 2**self.mu) / (1 - self.vocab_size ** (-epsilon))) ** (1 / s)
        except (ZeroDivisionError, OverflowError, ValueError):
            return len(sorted_probs) if epsilon > 0 else 1
        if isinstance(k, complex) or not math.isfinite(k):
            return len(sorted_probs)
        return min(int(k), len(sorted_probs))


class Dry:
    """DRY ("don't repeat yourself") for one request: a penalty on each token that would
    extend a sequence repeating earlier text, growing exponentially with the repeat's
    length past ``allowed_length``: ``multiplier * base ** (length - allowed_length)``.

    ``history``: the request's tokens so far (prompt, then output), of which the last
    ``last_n`` are looked at (-1: all). ``breakers``: token sequences (head first) that a
    repeat may not run across; a token that is a whole breaker by itself is never
    penalised. Follows llama.cpp's ``llama_sampler_dry_apply`` step for step: the repeat
    length is capped at the last breaker, each position's longest repeated suffix is
    found with the Z algorithm (linear time), and each next token takes the longest repeat
    it would extend."""

    def __init__(
        self,
        multiplier: float,
        base: float,
        allowed_length: int,
        last_n: int,
        breakers: Iterable[Sequence[int]],
        history: Sequence[int] = (),
    ) -> None:
        self.multiplier, self.base, self.allowed_length = multiplier, base, allowed_length
        self.history: deque[int] = deque(history, maxlen=None if last_n < 0 else last_n)
        self.breakers: dict[int, list[tuple[int, ...]]] = {}
        for breaker in breakers:
            if breaker:
                tails = self.breakers.setdefault(breaker[0], [])
                if tuple(breaker[1:]) not in tails:
                    tails.append(tuple(breaker[1:]))
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0

    def accept(self, token: int) -> None:
        self.history.append(token)

    def penalties(self) -> dict[int, float]:
        """Each token that would extend a repeat, with its penalty (none: empty)."""
        tokens = list(self.history)
        n = len(tokens)
        if n <= self.allowed_length:
            return {}
        limit = self._repeat_limit(tokens)
        if limit < self.allowed_length:
            return {}
        # z[k]: how many tokens before the end match the ones before position n-1-k
        # (the reversed history's Z array), capped at the limit.
        reverse = tokens[::-1]
        z = _z_array(reverse)
        longest: dict[int, int] = {}
        for k in range(1, n):
            length = min(z[k], limit)
            if length >= self.allowed_length:
                following = tokens[n - k]  # the token after the earlier occurrence
                if longest.get(following, -1) < length:
                    longest[following] = length
        penalties = {}
        for token, length in longest.items():
            if () in self.breakers.get(token, []):
                continue  # a breaker by itself ends repeats; never penalised
            exponent = length - self.allowed_length
            if self.max_exponent > 0:
                exponent = min(exponent, self.max_exponent)
            penalties[token] = self.multiplier * self.base**exponent
        return penalties

    def _repeat_limit(self, tokens: list[int]) -> int:
        """How far back a repeat may reach: up to the most recent breaker (the tokens
        after its last token), else the whole window."""
        n = len(tokens)
        for back in range(n):  # back: the candidate head's distance from the end
            tails = self.breakers.get(tokens[n - 1 - back])
            if not tails:
                continue
            matched = -1
            for tail in tails:
                size = len(tail)
                if matched < size <= back and all(
                    tail[offset] == tokens[n - back + offset] for offset in range(size)
                ):
                    matched = size
            if matched >= 0:
                return back - matched
        return n

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` less each token's penalty (a copy when any applies)."""
        penalties = self.penalties()
        if not penalties:
            return logits
        ids = [t for t in penalties if t < logits.shape[-1]]
        values = torch.tensor([penalties[t] for t in ids], dtype=logits.dtype)
        return logits.index_add(0, torch.tensor(ids, dtype=torch.long), -values)


def _z_array(sequence: Sequence[int]) -> list[int]:
    """``z[k]``: the length of the longest common prefix of ``sequence`` and
    ``sequence[k:]`` (``z[0]`` is the whole length)."""
    n = len(sequence)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0  # the rightmost match found: sequence[left:right] == sequence[:right-left]
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and sequence[z[k]] == sequence[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def breaker_sequences(
    breakers: Sequence[str],
    token_texts: Sequence[str],
    encode: Callable[[str], list[int]],
    max_chars: int = 40,
    max_tail: int = 20,
) -> tuple[tuple[int, ...], ...]:
    """DRY's sequence breakers as token sequences (head first), as llama.cpp processes
    them: a token whose text holds a breaker is a breaker by itself; a token whose text
    ends with the breaker's beginning is a head, followed by the tokens of the breaker's
    rest (at most ``max_tail``). Breakers are cut to ``max_chars`` characters."""
    found: dict[tuple[int, ...], None] = {}
    for raw in breakers:
        breaker = raw[:max_chars]
        if not breaker:
            continue
        tails: dict[str, tuple[int, ...]] = {}
        for token, text in enumerate(token_texts):
            if breaker in text:
                found[(token,)] = None
                continue
            start = text.find(breaker[0])
            while start >= 0:
                overlap = len(text) - start
                if overlap < len(breaker) and breaker.startswith(text[start:]):
                    rest = breaker[overlap:]
                    if rest not in tails:
                        tails[rest] = tuple(encode(rest)[:max_tail])
                    found[(token, *tails[rest])] = None
                start = text.find(breaker[0], start + 1)
    return tuple(found)


def held_back(logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``logits`` with ``ids`` at -inf (a copy), unless nothing else would be left: a
    grammar that allows only the end may still end (min_tokens never leaves no token)."""
    inside = [token for token in ids if token < logits.shape[-1]]
    if not inside:
        return logits
    index = torch.tensor(inside, dtype=torch.long)
    masked = logits.index_fill(0, index, float("-inf"))
    if not bool(torch.isfinite(masked).any()):
        return logits
    return masked
