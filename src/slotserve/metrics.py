"""Per-request timings and engine counters: one definition of every latency figure.

All times are ``time.monotonic()`` seconds. Derived figures follow DESIGN's rules: TTFT is
measured from submit; prefill throughput counts only computed (not restored) prompt tokens
and its span includes any restoration work.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slotserve.engine.engine import EngineStats


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
        """Computed prompt tokens per second over the whole prefill span (restoration
        included in the span, restored tokens excluded from the count)."""
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


LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class PrometheusMetrics:
    """Prometheus exposition of request timings (observed as requests end) and engine
    state (read from ``engine_stats()`` at scrape time). One registry per instance."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("slotserve_time_to_first_token_seconds", "TTFT, from submit")
        self.itl = histogram("slotserve_inter_token_latency_seconds", "Inter-token latency")
        self.queue = histogram("slotserve_queue_time_seconds", "Submit to admission")
        self.e2e = histogram("slotserve_request_duration_seconds", "Submit to finish")
        self.cancel = histogram("slotserve_cancel_release_seconds", "Cancel to KV release")
        self.prompt_tokens = Counter(
            "slotserve_prompt_tokens", "Prompt tokens computed", registry=self.registry
        )
        self.generated_tokens = Counter(
            "slotserve_generated_tokens", "Tokens generated", registry=self.registry
        )
        self.registry.register(_EngineCollector(engine_stats))

    def observe(self, timings: RequestTimings, generated: int) -> None:
        """Record one request that ended (called on the engine thread)."""
        for value, histogram in (
            (timings.ttft, self.ttft),
            (timings.queue_time, self.queue),
            (timings.cancel_to_release, self.cancel),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in timings.itl:
            self.itl.observe(gap)
        if timings.finished is not None:
            self.e2e.observe(timings.finished - timings.submitted)
        self.prompt_tokens.inc(timings.prompt_tokens_computed or 0)
        self.generated_tokens.inc(generated)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


class _EngineCollector:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.engine_stats = engine_stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine_stats()
        for name, doc, value in (
            ("slotserve_slots_in_use", "Live sessions", stats.slots_in_use),
            ("slotserve_max_seqs", "The slot ceiling", stats.max_seqs),
            ("slotserve_kv_blocks_used", "KV blocks (or rows) held", stats.kv_blocks_used),
            ("slotserve_kv_blocks_free", "KV blocks (or rows) free", stats.kv_blocks_free),
            ("slotserve_queue_length", "Requests waiting for a slot", stats.queue_len),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        refusals = CounterMetricFamily(
            "slotserve_admissions_refused", "Refusals by reason", labels=["reason"]
        )
        for reason, count in sorted(stats.refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals
        yield CounterMetricFamily(
            "slotserve_cancellations", "Requests cancelled", value=stats.cancellations
        )
        finished = CounterMetricFamily(
            "slotserve_requests_finished", "Requests ended, by reason", labels=["reason"]
        )
        for reason, count in sorted(stats.finished.items()):
            finished.add_metric([reason], count)
        yield finished
