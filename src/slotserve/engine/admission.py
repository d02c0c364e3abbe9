"""Building a `Request` from a submit call, and the refusals that need no engine state."""

from __future__ import annotations

import time
from collections.abc import Callable

from slotserve.engine.config import EngineConfig
from slotserve.engine.events import PRIORITIES
from slotserve.engine.request import Request
from slotserve.engine.sink import EventSink
from slotserve.errors import AdmissionRefused
from slotserve.metrics import RequestTimings
from slotserve.model import Model
from slotserve.sampling import RequestSampler, SamplingParams, StopMatcher


def build_request(
    request_id: int,
    model: Model,
    config: EngineConfig,
    prompt: str | list[int],
    params: SamplingParams,
    priority: str,
    clock: Callable[[], float] = time.monotonic,
) -> Request:
    """Tokenise and check a request against the context; raises `ValueError` for bad
    input and `AdmissionRefused("context_too_long")` for a request that cannot fit."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r} is not one of {PRIORITIES}")
    tokens = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise ValueError("the prompt is empty")
    vocab = model.info.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    needed = len(tokens) + params.max_new_tokens
    if needed > config.max_context:
        raise AdmissionRefused(
            "context_too_long",
            f"prompt of {len(tokens)} tokens + max_new_tokens={params.max_new_tokens} = "
            f"{needed} exceeds max_context={config.max_context}; shorten the prompt or lower "
            f"max_new_tokens to at most {max(config.max_context - len(tokens), 0)}",
        )
    eos = frozenset() if params.ignore_eos else frozenset(model.tokenizer.eos_ids)
    return Request(
        request_id=request_id,
        prompt=tokens,
        params=params,
        priority=priority,
        max_new_tokens=params.max_new_tokens,
        sampler=RequestSampler(params, vocab, tokens),
        decoder=model.tokenizer.stream_decoder(),
        stops=StopMatcher(params.stop),
        eos_ids=eos,
        sink=EventSink(),
        timings=RequestTimings(submitted=clock()),
        clock=clock,
    )
