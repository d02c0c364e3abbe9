"""The sampler: one request's seeded `RequestSampler` and the batched entry point
`sample_batch`, with the logit transforms they chain (logit bias → grammar mask → penalties
→ DRY → min_tokens' hold → top-n-sigma → temperature → top-k → typical → top-p → min-p →
XTC → draw; mirostat draws in place of top-k … XTC), and `token_logprobs`. llama.cpp's
samplers (`chain`) keep their definitions; their place in the chain is this one's, which
applies the temperature before the filters as Hugging Face and vLLM do (llama.cpp applies
it last), so a request that uses only OpenAI's fields samples as before.

Bias and mask are per request, applied row by row inside the batched sampler, so
constrained and free requests share a batch step. Owns each request's sampling state (RNG,
token counts, bias); the grammar's state is its `GrammarMatcher`'s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from slotserve.sampling.chain import Dry, Mirostat, held_back, top_n_sigma, typical, xtc
from slotserve.sampling.cpu import greedy_tokens, private_copy
from slotserve.sampling.params import SamplingParams


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
        # numpy views of the same memory: a token's two updates are two scalar stores, which
        # as torch ops would pay the per-op dispatch on every sampled token
        self._seen, self._counts = self.seen.numpy(), self.generated_counts.numpy()
        if prompt:
            self._seen[list(prompt)] = True
        self.bias = _bias_tensors(params.logit_bias, vocab_size)
        self.matcher = params.grammar.matcher(vocab_size) if params.grammar is not None else None
        self.produced = 0  # tokens accepted (min_tokens counts them)
        self.dry = (
            Dry(
                params.dry_multiplier,
                params.dry_base,
                params.dry_allowed_length,
                params.dry_penalty_last_n,
                params.dry_breakers,
                prompt,
            )
            if params.dry
            else None
        )
        self.mirostat = (
            Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, vocab_size)
            if params.mirostat
            else None
        )

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

    @property
    def shapes_logits(self) -> bool:
        """Whether this request's own history changes its logits before a greedy pick
        (penalties, DRY, or min_tokens still holding the end back)."""
        params = self.params
        holding = self.produced < params.min_tokens and bool(params.min_tokens_ids)
        return params.has_penalties or self.dry is not None or holding

    def accept(self, token: int) -> None:
        """Record a token the request produced (feeds the penalties and the grammar)."""
        self._seen[token] = True
        self._counts[token] += 1
        self.produced += 1
        if self.dry is not None:
            self.dry.accept(token)
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
        if self.dry is not None:
            logits = self.dry.apply(logits)
        if self.produced < params.min_tokens:
            logits = held_back(logits, params.min_tokens_ids)
        if params.greedy:
            return greedy_tokens(logits.reshape(1, -1))[0]
        if self.mirostat is not None:
            probs = torch.softmax(logits.double() / params.temperature, dim=-1)
            if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
                return int(logits.argmax())
            return self.mirostat.draw(probs, self.generator)
        logits = top_n_sigma(logits, params.top_n_sigma)
        values, candidates = logits, None
        if params.top_k and params.top_k < logits.shape[-1]:
            # Top-k first, on the raw logits (temperature keeps their order): the double
            # conversion, softmax, top-p and min-p then handle k values, not the vocabulary
            # (with the default top_k 40 on a 49k vocabulary, well under a millisecond
            # instead of several). Same result: the filters renormalise over what top-k keeps.
            values, candidates = torch.topk(logits, params.top_k)
        probs = filter_probs(torch.softmax(values.double() / params.temperature, dim=-1), params)
        if params.xtc_probability > 0.0:
            probs = xtc(probs, params.xtc_threshold, params.xtc_probability, self.generator)
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
    """Zero out what top-k, typical, top-p and min-p exclude (the top token always
    survives)."""
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.typical_p < 1.0:
        probs = typical(probs, params.typical_p)
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
        logits = private_copy(logits)
        for sampler, row in zip(samplers, logits, strict=True):
            if sampler.restricts:
                sampler.restrict(row)
    if all(s.params.greedy and not s.shapes_logits for s in samplers):
        tokens = greedy_tokens(logits)
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
