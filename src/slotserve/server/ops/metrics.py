"""Prometheus exposition: request timings observed as requests end (the engine's public
`Finished` events), engine state read from `Engine.stats()` at scrape time (the declared
cancellation bound among it, beside the measured cancel→release p99, and the speculation
counters), and the server's connections (open, refused by each cap, closed at each
deadline) read from its `ConnectionTracker` at scrape time.

A served set of models (`ModelSet`) labels every per-model sample ``model="NAME"``: the
request timings and token counters of each model, each loaded model's engine state (an
encoder's own reading for an embedding model), and the set's own families (each model's
state and bytes, the budget and what the device plan holds). A family is one HELP and TYPE
however many models it holds (`_Families`). One model: no ``model`` label, as ever."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

from slotserve.engine import Engine, EngineStats, Finished, PrefixStats
from slotserve.engine.cancel_bound import CancelBound
from slotserve.engine.encoder import EncoderStats
from slotserve.engine.models import MODEL_STATES, ModelSet
from slotserve.engine.speculate import SpeculationStats
from slotserve.engine.views import PrefixStoreStats
from slotserve.memory import read_process
from slotserve.prefix import REFUSAL_REASONS, SKIP_REASONS
from slotserve.server.http.connections import ConnectionStats

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
# One engine's reading as /metrics shows it: an engine's, or an encoder engine's.
Reading = EngineStats | EncoderStats


@dataclass(frozen=True)
class _RequestSeries:
    """One model's request metrics (the unlabelled ones of a one-model server)."""

    ttft: Histogram
    itl: Histogram
    queue: Histogram
    e2e: Histogram
    cancel: Histogram
    prompt_tokens: Counter
    generated_tokens: Counter

    def labelled(self, model: str) -> _RequestSeries:
        """The series of model ``model`` (these are a served set's labelled families)."""
        return _RequestSeries(
            self.ttft.labels(model),
            self.itl.labels(model),
            self.queue.labels(model),
            self.e2e.labels(model),
            self.cancel.labels(model),
            self.prompt_tokens.labels(model),
            self.generated_tokens.labels(model),
        )

    def observe(self, finished: Finished) -> None:
        """Record one request that ended (called on its engine's thread)."""
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


class PrometheusMetrics:
    """Prometheus exposition of request timings (observed as requests end) and engine
    state (read at scrape time). One registry per instance.

    One model: ``engine_stats`` reads its engine (or an encoder engine), ``plan_arenas`` its
    plan. A served set
    (``models``, ``primary`` its first resident model): every loaded model's engine is
    read from the set instead and its plan's arenas are the set's (`ModelSet.arenas`);
    each sample carries ``model``; ``ttft``, ``itl``, ``queue`` and ``cancel`` are the
    primary's (the dashboard's view) and `observer` gives each model's hook."""

    def __init__(
        self,
        engine_stats: Callable[[], Reading],
        connection_stats: Callable[[], ConnectionStats] | None = None,
        plan_arenas: Callable[[], Mapping[str, int]] | None = None,
        *,
        models: ModelSet | None = None,
        primary: str | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        labels = () if models is None else ("model",)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self._families = _RequestSeries(
            histogram("slotserve_time_to_first_token_seconds", "TTFT, from submit"),
            histogram("slotserve_inter_token_latency_seconds", "Inter-token latency"),
            histogram("slotserve_queue_time_seconds", "Submit to admission"),
            histogram("slotserve_request_duration_seconds", "Submit to finish"),
            histogram("slotserve_cancel_release_seconds", "Cancel to KV release"),
            counter("slotserve_prompt_tokens", "Prompt tokens computed"),
            counter("slotserve_generated_tokens", "Tokens generated"),
        )
        self._series: dict[str, _RequestSeries] = {}
        if models is None:
            self._primary = self._families
            self.registry.register(_EngineCollector(lambda: [((), engine_stats())], ()))
        else:
            assert primary is not None, "a served set names its primary model"
            for card in models.cards():  # each generating model's series from the start
                if card["kind"] == "generate":
                    self.series(card["id"])
            self._primary = self.series(primary)
            self.registry.register(_EngineCollector(partial(_set_readings, models), labels))
            self.registry.register(_ModelSetCollector(models))
            plan_arenas = models.arenas
        self.ttft, self.itl = self._primary.ttft, self._primary.itl
        self.queue, self.e2e = self._primary.queue, self._primary.e2e
        self.cancel = self._primary.cancel
        self.prompt_tokens = self._primary.prompt_tokens
        self.generated_tokens = self._primary.generated_tokens
        if connection_stats is not None:  # served by `serve` (its protocol counts them)
            self.registry.register(_ConnectionCollector(connection_stats))
        if plan_arenas is not None:
            self.registry.register(_MemoryCollector(plan_arenas))

    def series(self, model: str) -> _RequestSeries:
        """Model ``model``'s request metrics (a served set's; made on first use)."""
        known = self._series.get(model)
        if known is None:
            known = self._series[model] = self._families.labelled(model)
        return known

    def observe(self, finished: Finished) -> None:
        """Record one request that ended (called on the engine thread): the one model's,
        or a served set's primary model's."""
        self._primary.observe(finished)

    def observer(self, model: str) -> Callable[[Finished], None]:
        """The hook recording model ``model``'s ended requests (an engine's
        ``on_finished``): a served set's; the one model's is `observe`."""
        return self.series(model).observe

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


def _set_readings(models: ModelSet) -> list[tuple[tuple[str, ...], Reading]]:
    """Each loaded model's engine reading, labelled by its name (an unloaded model has no
    engine to read; a reloaded one starts its engine's counters again)."""
    readings: list[tuple[tuple[str, ...], Reading]] = []
    for name in models.names:
        engine = models.engine(name)
        if isinstance(engine, Engine):
            readings.append(((name,), engine.stats()))
        elif engine is not None and isinstance(stats := engine.stats(), EncoderStats):
            readings.append(((name,), stats))
    return readings


class _Families:
    """Metric families in the order first named, for one scrape: each sample labelled by
    the collector's labels (``base``: ``model`` on a served set, none for one model) and
    then its family's own (``reason``, ``rule`` …), so a family is one HELP and TYPE
    however many models add samples to it."""

    def __init__(self, base: Sequence[str]) -> None:
        self.base = tuple(base)
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def family(
        self, kind: Literal["gauge", "counter"], name: str, doc: str, own: Sequence[str] = ()
    ) -> GaugeMetricFamily | CounterMetricFamily:
        """The family ``name`` (declared here on first use, with ``doc``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        known = self._families.get(name)
        if known is None:
            make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            known = self._families[name] = make(name, doc, labels=[*self.base, *own])
        return known

    def gauge(self, at: Sequence[str], name: str, doc: str, value: float, **own: str) -> None:
        """A gauge sample of the collector's labels ``at`` and its own labels ``own``."""
        family = self.family("gauge", name, doc, tuple(own))
        family.add_metric([*at, *own.values()], value)

    def counter(self, at: Sequence[str], name: str, doc: str, value: float, **own: str) -> None:
        """A counter sample (exposed as ``name_total``), labelled as `gauge`'s."""
        family = self.family("counter", name, doc, tuple(own))
        family.add_metric([*at, *own.values()], value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(list(self._families.values()))


class _MemoryCollector:
    """The process's memory as the kernel reads it (anonymous, the plan's measure, beside
    the resident set) and the plan's bytes by arena, at scrape time."""

    def __init__(self, plan_arenas: Callable[[], Mapping[str, int]]) -> None:
        self.plan_arenas = plan_arenas

    def collect(self) -> Iterator[Metric]:
        reading = read_process()
        out = _Families(())
        for name, doc, value in (
            ("slotserve_process_anonymous_bytes", "Anonymous (dirty) bytes", reading.anonymous),
            ("slotserve_process_resident_bytes", "Resident set", reading.resident),
            ("slotserve_process_file_bytes", "Resident file-backed pages", reading.file),
        ):
            out.gauge((), name, doc, value)
        arenas = "slotserve_plan_arena_bytes", "The memory plan's bytes by arena"
        out.family("gauge", *arenas, ("arena",))
        for arena, nbytes in self.plan_arenas().items():
            out.gauge((), *arenas, nbytes, arena=arena)
        yield from out


class _EngineCollector:
    """Each engine's reading (``readings``: its labels' values and its stats) at scrape
    time, under the labels ``base``."""

    def __init__(
        self,
        readings: Callable[[], list[tuple[tuple[str, ...], Reading]]],
        base: Sequence[str],
    ) -> None:
        self.readings, self.base = readings, base

    def collect(self) -> Iterator[Metric]:
        out = _Families(self.base)
        for at, stats in self.readings():
            if isinstance(stats, EncoderStats):
                _encoder_metrics(out, at, stats)
            else:
                _engine_metrics(out, at, stats)
        yield from out


def _engine_metrics(out: _Families, at: Sequence[str], stats: EngineStats) -> None:
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
        out.gauge(at, name, doc, value)
    if stats.pressure_level is not None:  # only with a pressure signal (serve --pressure)
        out.gauge(
            at, "slotserve_pressure_level", "Device pressure (1.0: threshold)",
            stats.pressure_level,
        )  # fmt: skip
    _ends(out, at, stats.refusals, stats.cancellations, stats.finished)
    _speculation_metrics(out, at, stats.speculation)
    if stats.cancel_bound is not None:
        _cancel_bound_metrics(out, at, stats.cancel_bound)
    if stats.prefix is not None:  # only with the prefix cache (serve --prefix-cache)
        _prefix_metrics(out, at, stats.prefix)


def _ends(
    out: _Families,
    at: Sequence[str],
    refusals: Mapping[str, int],
    cancellations: int,
    finished: Mapping[str, int],
) -> None:
    """Refusals by reason, cancellations and ends by reason (an engine's or an
    encoder's)."""
    refused = "slotserve_admissions_refused", "Refusals by reason"
    out.family("counter", *refused, ("reason",))
    for reason, count in sorted(refusals.items()):
        out.counter(at, *refused, count, reason=reason)
    out.counter(at, "slotserve_cancellations", "Requests cancelled", cancellations)
    ended = "slotserve_requests_finished", "Requests ended, by reason"
    out.family("counter", *ended, ("reason",))
    for reason, count in sorted(finished.items()):
        out.counter(at, *ended, count, reason=reason)


def _speculation_metrics(
    out: _Families, at: Sequence[str], speculation: SpeculationStats | None
) -> None:
    """The speculation counters (`SpeculationStats`): 0 where the engine does not draft
    (``speculate=off``, or refused where drafts could change the output), which
    ``slotserve_speculation_enabled`` tells apart from drafting nothing yet."""
    enabled = speculation is not None
    out.gauge(
        at, "slotserve_speculation_enabled",
        "1 where the engine drafts tokens and verifies them (serve --speculate ngram), 0 "
        "where it does not (off, or refused where a draft could change the output: logged "
        "at start); the speculation counters stay 0 then",
        1 if enabled else 0,
    )  # fmt: skip
    none = SpeculationStats(0, 0, 0, 0, 0.0)
    counts = speculation or none
    for name, doc, value in (
        ("slotserve_speculation_drafted_tokens",
         "Tokens drafted and verified by the target in a step (0 while not speculating)",
         counts.drafted),
        ("slotserve_speculation_accepted_tokens",
         "Drafted tokens accepted: equal to the request's own sampler's pick (0 while not "
         "speculating)", counts.accepted),
        ("slotserve_speculation_rejected_tokens",
         "Drafted tokens rejected and their KV rows rolled back; drafted = accepted + "
         "rejected (0 while not speculating)", counts.rejected),
        ("slotserve_speculation_steps",
         "Steps that verified at least one draft (0 while not speculating)", counts.steps),
    ):  # fmt: skip
        out.counter(at, name, doc, value)


def _encoder_metrics(out: _Families, at: Sequence[str], stats: EncoderStats) -> None:
    """An embedding model's reading (`EncoderStats`): its text slots and queue, the forward
    it holds between layers, what it embedded, and its ends (the families it shares with a
    generating model's)."""
    out.gauge(at, "slotserve_queue_length", "Requests waiting for a slot", stats.queue_len)
    for name, doc, value in (
        ("slotserve_encoder_texts_in_use", "Texts admitted, not yet embedded",
         stats.texts_in_use),
        ("slotserve_encoder_max_texts", "The ceiling on admitted texts", stats.max_texts),
        ("slotserve_encoder_requests_running", "Embedding requests admitted", stats.running),
        ("slotserve_encoder_held_bytes",
         "Bytes of a forward held between layers (a step split by layer; within the plan)",
         stats.held_bytes),
    ):  # fmt: skip
        out.gauge(at, name, doc, value)
    out.counter(at, "slotserve_encoder_texts_embedded", "Texts embedded", stats.texts_embedded)
    out.counter(at, "slotserve_encoder_steps", "Encoder steps run", stats.steps)
    _ends(out, at, stats.refusals, stats.cancellations, stats.finished)


class _ModelSetCollector:
    """A served set's own state at scrape time: each model's kind, state, planned and
    held bytes, leases and loads (labelled ``model``), and the set's budget, the bytes its
    device plan holds now, what it must hold at worst and its shared arenas."""

    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        models = self.models
        out = _Families(("model",))
        for card in models.cards():
            at = (card["id"],)
            out.gauge(
                at, "slotserve_model_info", "A served model (1): its kind and residency",
                1, kind=card["kind"], resident=str(card["resident"]).lower(),
            )  # fmt: skip
            for state in MODEL_STATES:
                out.gauge(
                    at, "slotserve_model_state", "1 for the model's state now, else 0",
                    float(card["state"] == state), state=state,
                )  # fmt: skip
            held = card["bytes"] if card["state"] != "unloaded" else 0
            for name, doc, value in (
                ("slotserve_model_planned_bytes",
                 "The model's plan (its arenas, KV and activations, or its load's peak "
                 "where higher), measured at start", card["bytes"]),
                ("slotserve_model_resident_bytes",
                 "What the model holds in the device plan now: its plan while loaded or "
                 "loading, else 0", held),
                ("slotserve_model_leases", "Requests between naming the model and "
                 "submitting to it", card["leases"]),
            ):  # fmt: skip
                out.gauge(at, name, doc, value)
            out.counter(at, "slotserve_model_loads", "Loads of the model", card["loads"])
            out.counter(at, "slotserve_model_unloads", "Unloads of the model", card["unloads"])
        whole = _Families(())
        if models.budget is not None:  # only with --memory-budget
            whole.gauge((), "slotserve_models_budget_bytes", "The device's budget (--memory-"
                        "budget) that every model's plan shares", models.budget)  # fmt: skip
        for name, doc, value in (
            ("slotserve_models_used_bytes", "What the device plan holds now: the shared "
             "arenas, the loaded models' plans and a load's reservation", models.used_bytes),
            ("slotserve_models_required_bytes", "What the budget must hold at worst: the "
             "shared arenas, the residents and the largest on-demand model",
             models.required_bytes),
            ("slotserve_models_shared_bytes", "The process's arenas outside every model",
             models.shared_bytes),
        ):  # fmt: skip
            whole.gauge((), name, doc, value)
        yield from out
        yield from whole


class _ConnectionCollector:
    def __init__(self, connection_stats: Callable[[], ConnectionStats]) -> None:
        self.connection_stats = connection_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.connection_stats()
        out = _Families(())
        out.gauge((), "slotserve_connections_open", "HTTP connections open", stats.open)
        out.gauge(
            (), "slotserve_max_connections", "The cap on open connections",
            stats.max_connections,
        )  # fmt: skip
        refused = "slotserve_connections_refused", "Connections answered 503 beyond a cap, by cap"
        out.family("counter", *refused, ("limit",))
        for cap, count in stats.refused.items():
            out.counter((), *refused, count, limit=cap)
        timed_out = (
            "slotserve_connections_timed_out",
            "Connections closed at a deadline (head: --header-timeout, body: --body-timeout)",
        )
        out.family("counter", *timed_out, ("deadline",))
        for deadline, count in stats.timed_out.items():
            out.counter((), *timed_out, count, deadline=deadline)
        out.counter(
            (), "slotserve_connections_evicted",
            "Idle kept-alive connections closed to make room for a new one at a cap",
            stats.evicted,
        )  # fmt: skip
        yield from out


def _cancel_bound_metrics(out: _Families, at: Sequence[str], bound: CancelBound) -> None:
    """The declared worst-case cancel→release time (the time of the largest step the
    config allows, labelled with how it was estimated; absent before any step ran), that
    step's size, and beside them the measured cancel→release p99 and maximum (absent
    before any cancel)."""
    out.gauge(
        at, "slotserve_cancel_bound_step_tokens",
        "Tokens of the largest step the config allows: a cancel waits for at most one",
        bound.max_step_tokens,
    )  # fmt: skip
    if bound.estimate_s is not None:
        out.gauge(
            at, "slotserve_cancel_bound_seconds",
            "Declared worst-case cancel to release: the largest step's time, by basis",
            bound.estimate_s, basis=bound.basis,
        )  # fmt: skip
    for name, doc, value in (
        ("slotserve_cancel_release_p99_seconds", "Measured cancel to release, p99",
         bound.measured_p99_s),
        ("slotserve_cancel_release_max_seconds", "Measured cancel to release, maximum",
         bound.measured_max_s),
    ):  # fmt: skip
        if value is not None:
            out.gauge(at, name, doc, value)


def _prefix_metrics(out: _Families, at: Sequence[str], stats: PrefixStats) -> None:
    """The prefix cache's counters and gauges."""
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
        out.counter(at, name, doc, count)
    rejections = (
        "slotserve_prefix_rejections",
        "Token-equal prefixes a retention rule refused, by rule",
    )
    out.family("counter", *rejections, ("rule",))
    for rule, count in sorted(stats.rejections_by_rule.items()):
        out.counter(at, *rejections, count, rule=rule)
    for name, doc, value in (
        ("slotserve_prefix_bytes_pinned", "KV bytes the snapshots pin", stats.bytes_pinned),
        ("slotserve_prefix_budget_bytes", "KV bytes the cache may pin", stats.budget_bytes),
        ("slotserve_prefix_snapshots", "Snapshots held", stats.snapshots),
    ):
        out.gauge(at, name, doc, value)
    if stats.store is not None:  # only with the disk tier (serve --prefix-store)
        _store_metrics(out, at, stats.store)


def _store_metrics(out: _Families, at: Sequence[str], store: PrefixStoreStats) -> None:
    """The prefix store's counters and gauges: files refused by reason (never served),
    writes skipped by reason, restores from disk."""
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
        out.counter(at, name, doc, count)
    for reason in REFUSAL_REASONS:
        out.counter(
            at, "slotserve_prefix_store_refused",
            "Stored files refused and never served, by reason",
            store.refused.get(reason, 0), reason=reason,
        )  # fmt: skip
    for reason in SKIP_REASONS:
        out.counter(
            at, "slotserve_prefix_store_writes_skipped", "Snapshots not written, by reason",
            store.skipped.get(reason, 0), reason=reason,
        )  # fmt: skip
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
        out.gauge(at, name, doc, value)
