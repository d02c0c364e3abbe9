"""Per-request timings and engine counters: one definition of every latency figure.

All times are seconds on the engine's clock (``time.monotonic`` unless a test injects one).
Derived figures follow DESIGN's rules: TTFT is measured from submit; prefill throughput
counts only computed prompt tokens. Tokens restored from the prefix cache are counted apart
(``prompt_tokens_restored``) and left out of throughput, while the time of the restoration
(the cache lookup and the copy-on-write bind, at admission) is inside the prefill span.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTimings:
    """Timestamps of one request's life, filled in by the engine thread."""

    submitted: float
    admitted: float | None = None
    first_scheduled: float | None = None
    prefill_done: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    released: float | None = None
    cancel_requested: float | None = None
    prompt_tokens_computed: int = 0
    prompt_tokens_restored: int = 0
    # When the prefix cache was consulted for this request (at admission; None: cache off)
    # and how long the lookup and restoration took. The prefill span starts here.
    restore_started: float | None = None
    restore_time: float = 0.0
    # Seconds spent choosing this request's tokens from logits (its share of each batched
    # sampling call, split evenly between the requests sampled together).
    sampling_time: float = 0.0
    # Speculation: tokens drafted for this request and how many of them were accepted
    # (delivered without a step of their own); the rest were rejected.
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def ttft(self) -> float | None:
        """Time to first token, from submit."""
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        itl = self.itl
        return statistics.fmean(itl) if itl else None

    @property
    def prefill_started(self) -> float | None:
        """Start of the prefill span: the restoration if there was one (it comes first),
        else the first step."""
        starts = [t for t in (self.restore_started, self.first_scheduled) if t is not None]
        return min(starts) if starts else None

    @property
    def prefill_time(self) -> float | None:
        """From the start of restoration (or the first step) to the end of the prompt."""
        started = self.prefill_started
        if self.prefill_done is None or started is None:
            return None
        return self.prefill_done - started

    @property
    def prefill_tok_s(self) -> float | None:
        """Computed prompt tokens per second over the whole prefill span, restoration
        included (restored tokens are left out of the count)."""
        span = self.prefill_time
        return self.prompt_tokens_computed / span if span else None

    @property
    def cancel_to_release(self) -> float | None:
        if self.cancel_requested is None or self.released is None:
            return None
        return self.released - self.cancel_requested

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_time_s": self.queue_time,
            "ttft_s": self.ttft,
            "itl_s": self.itl,
            "tpot_s": self.tpot,
            "prefill_time_s": self.prefill_time,
            "prefill_tok_s": self.prefill_tok_s,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_restored": self.prompt_tokens_restored,
            "restore_time_s": self.restore_time,
            "cancel_to_release_s": self.cancel_to_release,
            "sampling_time_s": self.sampling_time,
        }


STEPS_BY_SIZE = 256  # step times kept per step size (tokens)


@dataclass
class EngineCounters:
    """Monotone counters the engine thread updates (read through `Engine.stats`)."""

    admitted: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    cancellations: int = 0
    steps_by_batch_size: Counter[int] = field(default_factory=Counter)
    steps_by_class: Counter[str] = field(default_factory=Counter)
    # The latest step times (bounded: a server runs for months).
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    # The latest step times by the tokens the step fed (the cancellation bound's basis),
    # and the latest cancel→release latencies.
    step_seconds_by_tokens: dict[int, deque[float]] = field(default_factory=dict)
    cancel_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def count_step(
        self, batch_size: int, priority: str, seconds: float, tokens: int | None = None
    ) -> None:
        self.steps_by_batch_size[batch_size] += 1
        self.steps_by_class[priority] += 1
        self.step_seconds.append(seconds)
        if tokens is not None:
            self.count_step_time(tokens, seconds)

    def count_step_time(self, tokens: int, seconds: float) -> None:
        """Record a step of ``tokens`` that took ``seconds`` for the cancellation bound
        only (`Engine.measure_cancel_bound`'s step serves no request)."""
        by_size = self.step_seconds_by_tokens.get(tokens)
        if by_size is None:
            by_size = self.step_seconds_by_tokens[tokens] = deque(maxlen=STEPS_BY_SIZE)
        by_size.append(seconds)
