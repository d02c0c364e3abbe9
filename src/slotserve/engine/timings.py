"""Per-request timings and engine counters: one definition of every latency figure.

All times are seconds on the engine's clock (``time.monotonic`` unless a test injects one).
Derived figures follow DESIGN's rules: TTFT is measured from submit; prefill throughput
counts only computed prompt tokens. Nothing restores prompt tokens from a prefix cache yet,
so ``prompt_tokens_restored`` is 0 and the prefill span is all computation; when a prefix
cache lands, restored tokens leave the count and their restoration stays inside the span.
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
    # Seconds spent choosing this request's tokens from logits (its share of each batched
    # sampling call, split evenly between the requests sampled together).
    sampling_time: float = 0.0

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
    def prefill_time(self) -> float | None:
        if self.prefill_done is None or self.first_scheduled is None:
            return None
        return self.prefill_done - self.first_scheduled

    @property
    def prefill_tok_s(self) -> float | None:
        """Computed prompt tokens per second over the whole prefill span (restored tokens,
        none yet, are left out of the count)."""
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
            "cancel_to_release_s": self.cancel_to_release,
            "sampling_time_s": self.sampling_time,
        }


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

    def count_step(self, batch_size: int, priority: str, seconds: float) -> None:
        self.steps_by_batch_size[batch_size] += 1
        self.steps_by_class[priority] += 1
        self.step_seconds.append(seconds)
