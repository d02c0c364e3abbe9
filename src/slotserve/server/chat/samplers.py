"""A request's llama.cpp and vLLM sampler fields as `SamplingParams` fields: the plain
numbers as they come, DRY's sequence breakers as token sequences for this model's
tokenizer (`chain.breaker_sequences`: every token's text is read once per tokenizer, the
breakers once per set), and min_tokens' end-of-sequence tokens.

What each sampler does is `slotserve.sampling.chain`'s; here only the request's names
(llama.cpp's ``repeat_penalty`` is ``repetition_penalty``) and what needs the tokenizer.
"""

from __future__ import annotations

import functools
from typing import Any

from slotserve.sampling.chain import breaker_sequences
from slotserve.server.openai.schemas import DRY_BREAKERS, SamplingFields
from slotserve.tokenizer import Tokenizer


@functools.lru_cache(maxsize=4)
def _token_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Each token's text (special tokens' too), in id order."""
    return tuple(tokenizer.decode([token]) for token in range(tokenizer.vocab_size))


@functools.lru_cache(maxsize=32)
def dry_breakers(tokenizer: Tokenizer, breakers: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """DRY's ``breakers`` as token sequences for ``tokenizer``."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False)

    return breaker_sequences(breakers, _token_texts(tokenizer), encode)


def chain_fields(tokenizer: Tokenizer, body: SamplingFields) -> dict[str, Any]:
    """The `SamplingParams` fields of ``body``'s llama.cpp and vLLM samplers (those it
    leaves out keep their defaults: off)."""
    fields: dict[str, Any] = {}
    for name in (
        "typical_p",
        "top_n_sigma",
        "xtc_probability",
        "xtc_threshold",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "min_tokens",
    ):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.dry_multiplier and body.dry_penalty_last_n != 0:
        breakers = tuple(body.dry_sequence_breakers or DRY_BREAKERS)
        fields["dry_breakers"] = dry_breakers(tokenizer, breakers)
    if body.min_tokens:  # with stop strings too: `StopMatcher` waits for min_tokens
        fields["min_tokens_ids"] = tuple(tokenizer.eos_ids)
    return fields
