"""Typed events a request's handle yields, the cancel acknowledgement, and the literal
types of priorities and finish reasons."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from slotserve.engine.timings import RequestTimings
from slotserve.info import POOLINGS, Pooling

Priority = Literal["interactive", "normal", "background"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)  # highest class first
FinishReason = Literal["stop", "length", "cancelled", "error"]
# `Pooling` (info.py): how an embedding request pools its prompt's final hidden states.
__all__ = ["POOLINGS", "PRIORITIES", "FinishReason", "Pooling", "Priority", "check_priority"]


def check_priority(value: str) -> Priority:
    """``value`` as a `Priority`, or a `ValueError` naming the allowed classes."""
    for priority in PRIORITIES:
        if value == priority:
            return priority
    raise ValueError(f"priority={value!r} is not one of {PRIORITIES}")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it released (may be empty: text is held back
    until a UTF-8 character or a possible stop string is complete). ``token_id == -1``
    marks text released at the end of the request with no new token."""

    token_id: int
    text: str
    index: int
    time: float
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    """The one terminal event of a request that ran (``priority``: its class;
    ``embedding``: an embedding request's pooled, L2-normalised vector)."""

    reason: FinishReason
    usage: Usage
    timings: RequestTimings
    text: str
    tokens: tuple[int, ...]
    error: str | None = None
    eos_token: int | None = None  # the end-of-sequence token that ended it, if any
    priority: Priority = "normal"
    embedding: tuple[float, ...] | None = None


@dataclass(frozen=True)
class CancelAck:
    """The engine released the request's slot and KV ``latency_s`` after cancel()."""

    latency_s: float


Event = TokenEvent | Finished
