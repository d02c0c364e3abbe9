"""Prometheus exposition: request timings observed as requests end (the engine's public
`Finished` events), engine state read from `Engine.stats()` at scrape time (the declared
cancellation bound among it, beside the measured cancel→release p99), and the server's
connections (open, refused by each cap, closed at each deadline) read from its
`ConnectionTracker` at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from slotserve.engine import EngineStats, Finished, PrefixStats
from slotserve.engine.cancel_bound import CancelBound
from slotserve.engine.views import PrefixStoreStats
from slotserve.memory import read_process
from slotserve.prefix import REFUSAL_REASONS, SKIP_REASONS
from slotserve.server.connections import ConnectionStats

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

    def __init__(
        self,
        engine_stats: Callable[[], EngineStats],
        connection_stats: Callable[[], ConnectionStats] | None = None,
        plan_arenas: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
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
        if connection_stats is not None:  # served by `serve` (its protocol counts them)
            self.registry.register(_ConnectionCollector(connection_stats))
        if plan_arenas is not None:
            self.registry.register(_MemoryCollector(plan_arenas))

    def observe(self, finished: Finished) -> None:
        """Record one request that ended (called on the engine thread)."""
        timings = finished.timings
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
        self.generated_tokens.inc(len(finished.tokens))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


class _MemoryCollector:
    """The process's memory as the kernel reads it (anonymous, the plan's measure, beside
    the resident set) and the plan's bytes by arena, at scrape time."""

    def __init__(self, plan_arenas: Callable[[], Mapping[str, int]]) -> None:
        self.plan_arenas = plan_arenas

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        reading = read_process()
        for name, doc, value in (
            ("slotserve_process_anonymous_bytes", "Anonymous (dirty) bytes", reading.anonymous),
            ("slotserve_process_resident_bytes", "Resident set", reading.resident),
            ("slotserve_process_file_bytes", "Resident file-backed pages", reading.file),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        arenas = GaugeMetricFamily(
            "slotserve_plan_arena_bytes", "The memory plan's bytes by arena", labels=["arena"]
        )
        for arena, nbytes in self.plan_arenas().items():
            arenas.add_metric([arena], nbytes)
        yield arenas


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
            (
                "slotserve_kv_blocks_parked",
                "KV blocks (or rows) of the used that only the prefix cache holds (parked: "
                "reclaimable, not leaked)",
                stats.kv_blocks_parked,
            ),
            (
                "slotserve_kv_blocks_reclaimable",
                "KV blocks (or rows) a new request can have: the free and the parked",
                stats.kv_blocks_reclaimable,
            ),
            (
                "slotserve_slots_parked",
                "Idle slots keeping a finished request's KV for the prefix cache",
                stats.slots_parked,
            ),
            ("slotserve_queue_length", "Requests waiting for a slot", stats.queue_len),
            ("slotserve_kv_pool_bytes", "KV pool reserved by the plan", stats.kv_pool_bytes),
            (
                "slotserve_kv_resident_bytes",
                "KV pool resident: the pages sessions have written",
                stats.kv_resident_bytes,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        if stats.pressure_level is not None:  # only with a pressure signal (serve --pressure)
            yield GaugeMetricFamily(
                "slotserve_pressure_level", "Device pressure (1.0: threshold)", stats.pressure_level
            )
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
        if stats.cancel_bound is not None:
            yield from _cancel_bound_metrics(stats.cancel_bound)
        if stats.prefix is not None:  # only with the prefix cache (serve --prefix-cache)
            yield from _prefix_metrics(stats.prefix)


class _ConnectionCollector:
    def __init__(self, connection_stats: Callable[[], ConnectionStats]) -> None:
        self.connection_stats = connection_stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.connection_stats()
        yield GaugeMetricFamily("slotserve_connections_open", "HTTP connections open", stats.open)
        yield GaugeMetricFamily(
            "slotserve_max_connections", "The cap on open connections", stats.max_connections
        )
        refused = CounterMetricFamily(
            "slotserve_connections_refused",
            "Connections answered 503 beyond a cap, by cap",
            labels=["limit"],
        )
        for cap, count in stats.refused.items():
            refused.add_metric([cap], count)
        yield refused
        timed_out = CounterMetricFamily(
            "slotserve_connections_timed_out",
            "Connections closed at a deadline (head: --header-timeout, body: --body-timeout)",
            labels=["deadline"],
        )
        for deadline, count in stats.timed_out.items():
            timed_out.add_metric([deadline], count)
        yield timed_out
        yield CounterMetricFamily(
            "slotserve_connections_evicted",
            "Idle kept-alive connections closed to make room for a new one at a cap",
            value=stats.evicted,
        )


def _cancel_bound_metrics(bound: CancelBound) -> Iterator[Any]:
    """The declared worst-case cancel→release time (the time of the largest step the
    config allows, labelled with how it was estimated; absent before any step ran), that
    step's size, and beside them the measured cancel→release p99 and maximum (absent
    before any cancel)."""
    from prometheus_client.core import GaugeMetricFamily

    yield GaugeMetricFamily(
        "slotserve_cancel_bound_step_tokens",
        "Tokens of the largest step the config allows: a cancel waits for at most one",
        value=bound.max_step_tokens,
    )
    if bound.estimate_s is not None:
        declared = GaugeMetricFamily(
            "slotserve_cancel_bound_seconds",
            "Declared worst-case cancel to release: the largest step's time, by basis",
            labels=["basis"],
        )
        declared.add_metric([bound.basis], bound.estimate_s)
        yield declared
    for name, doc, value in (
        ("slotserve_cancel_release_p99_seconds", "Measured cancel to release, p99",
         bound.measured_p99_s),
        ("slotserve_cancel_release_max_seconds", "Measured cancel to release, maximum",
         bound.measured_max_s),
    ):  # fmt: skip
        if value is not None:
            yield GaugeMetricFamily(name, doc, value=value)


def _prefix_metrics(stats: PrefixStats) -> Iterator[Any]:
    """The prefix cache's counters and gauges."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, count in (
        ("slotserve_prefix_hits", "Admissions that restored a cached prefix", stats.hits),
        ("slotserve_prefix_misses", "Admissions with no usable prefix", stats.misses),
        (
            "slotserve_prefix_tokens_restored",
            "Prompt tokens restored from the cache instead of computed",
            stats.tokens_restored,
        ),
        ("slotserve_prefix_evictions", "Snapshots evicted", stats.evictions),
    ):
        yield CounterMetricFamily(name, doc, value=count)
    rejections = CounterMetricFamily(
        "slotserve_prefix_rejections",
        "Token-equal prefixes a retention rule refused, by rule",
        labels=["rule"],
    )
    for rule, count in sorted(stats.rejections_by_rule.items()):
        rejections.add_metric([rule], count)
    yield rejections
    for name, doc, value in (
        ("slotserve_prefix_bytes_pinned", "KV bytes the snapshots pin", stats.bytes_pinned),
        ("slotserve_prefix_budget_bytes", "KV bytes the cache may pin", stats.budget_bytes),
        ("slotserve_prefix_snapshots", "Snapshots held", stats.snapshots),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
    if stats.store is not None:  # only with the disk tier (serve --prefix-store)
        yield from _store_metrics(stats.store)


def _store_metrics(store: PrefixStoreStats) -> Iterator[Any]:
    """The prefix store's counters and gauges: files refused by reason (never served),
    writes skipped by reason, restores from disk."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, count in (
        ("slotserve_prefix_store_hits", "Admissions restored from the disk tier", store.hits),
        (
            "slotserve_prefix_store_tokens_restored",
            "Prompt tokens restored from the disk tier",
            store.tokens_restored,
        ),
        ("slotserve_prefix_store_written", "Snapshot files written", store.written),
        (
            "slotserve_prefix_store_bytes_written",
            "Bytes of snapshot files written (the flash the store wears)",
            store.bytes_written,
        ),
        ("slotserve_prefix_store_evictions", "Files evicted (LRU by bytes)", store.evictions),
        ("slotserve_prefix_store_covered", "Files deleted, covered by longer ones", store.covered),
        ("slotserve_prefix_store_torn_removed", "Torn temporary files removed", store.torn_removed),
    ):
        yield CounterMetricFamily(name, doc, value=count)
    refused = CounterMetricFamily(
        "slotserve_prefix_store_refused",
        "Stored files refused and never served, by reason",
        labels=["reason"],
    )
    for reason in REFUSAL_REASONS:
        refused.add_metric([reason], store.refused.get(reason, 0))
    yield refused
    skipped = CounterMetricFamily(
        "slotserve_prefix_store_writes_skipped",
        "Snapshots not written, by reason",
        labels=["reason"],
    )
    for reason in SKIP_REASONS:
        skipped.add_metric([reason], store.skipped.get(reason, 0))
    yield skipped
    for name, doc, value in (
        ("slotserve_prefix_store_bytes", "Bytes of the files on disk", store.bytes),
        ("slotserve_prefix_store_budget_bytes", "Bytes the store may keep", store.budget_bytes),
        ("slotserve_prefix_store_files", "Snapshot files indexed", store.files),
        ("slotserve_prefix_store_queued", "Snapshots offered, not yet written", store.queued),
        (
            "slotserve_prefix_store_index_seconds",
            "Seconds the start-up index took",
            store.index_seconds,
        ),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
