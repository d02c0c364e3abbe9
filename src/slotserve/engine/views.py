"""What the engine publishes to readers (the server, benches, the dashboard): typed, frozen
copies taken under the engine lock, so a reader never sees the engine mid-step and never
reaches into it.

`EngineStats` (`Engine.stats`) is the counters and gauges, with `PrefixStats` when the prefix
cache is on; `SlotView` (`Engine.slots`) is one slot and the request it serves; `PoolView`
(`Engine.pool_view`) is the KV pool's occupancy and exactly which cells each session and
snapshot holds, from the pool's own tables (`KVPool.holdings`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from slotserve.engine.cancel_bound import CancelBound
from slotserve.engine.events import Priority
from slotserve.engine.request import Request
from slotserve.engine.speculate import SpeculationStats
from slotserve.engine.timings import EngineCounters
from slotserve.kv.holdings import Holding, RowGroup
from slotserve.kv.pool import KVPool
from slotserve.prefix import PrefixCache
from slotserve.prefix.store import StoreReport

SlotState = Literal["idle", "prefill", "decode"]
PoolUnit = Literal["blocks", "rows"]


@dataclass(frozen=True)
class PrefixStoreStats:
    """The prefix cache's disk tier: its directory, the bytes it may keep and keeps, the
    files it indexes, how long indexing took at start, snapshots queued and written,
    bytes written, restores from disk and their tokens, files evicted (LRU by bytes) and deleted as
    covered by a longer one, torn temporary files removed at start; files refused by
    reason (`slotserve.prefix.REFUSAL_REASONS`: never served) and writes skipped by reason
    (`slotserve.prefix.SKIP_REASONS`)."""

    directory: str
    budget_bytes: int
    bytes: int
    files: int
    index_seconds: float
    queued: int
    written: int
    bytes_written: int
    hits: int
    tokens_restored: int
    evictions: int
    covered: int
    torn_removed: int
    refused: dict[str, int]
    skipped: dict[str, int]


def store_stats(report: StoreReport) -> PrefixStoreStats:
    """The store's `StoreReport` as a frozen view."""
    counters = report.counters
    return PrefixStoreStats(
        directory=report.directory,
        budget_bytes=report.budget_bytes,
        bytes=report.bytes,
        files=report.files,
        index_seconds=report.index_seconds,
        queued=report.queued,
        written=counters.written,
        bytes_written=counters.bytes_written,
        hits=counters.hits,
        tokens_restored=counters.tokens_restored,
        evictions=counters.evictions,
        covered=counters.covered,
        torn_removed=counters.torn_removed,
        refused=dict(counters.refused),
        skipped=dict(counters.skipped),
    )


@dataclass(frozen=True)
class PrefixStats:
    """The prefix cache: the bytes it may pin, restores that hit or missed, token-equal
    prefixes a retention rule refused (in all and by rule), tokens restored instead of
    computed, the bytes its snapshots pin, snapshots held and evicted; ``store``, its disk
    tier (None without one). Hits and tokens restored count both tiers."""

    budget_bytes: int
    hits: int
    misses: int
    rejections: int
    rejections_by_rule: dict[str, int]
    tokens_restored: int
    bytes_pinned: int
    snapshots: int
    evictions: int
    store: PrefixStoreStats | None = None


def prefix_stats(cache: PrefixCache | None) -> PrefixStats | None:
    """``cache``'s counters as a frozen view (None with the prefix cache off)."""
    if cache is None:
        return None
    counters = cache.stats
    return PrefixStats(
        budget_bytes=cache.budget_bytes,
        hits=counters.hits,
        misses=counters.misses,
        rejections=counters.rejections,
        rejections_by_rule=dict(counters.rejections_by_rule),
        tokens_restored=counters.tokens_restored,
        bytes_pinned=cache.bytes_pinned,
        snapshots=len(cache),
        evictions=counters.evictions,
        store=None if cache.store is None else store_stats(cache.store.report()),
    )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. KV blocks are cell blocks (cell layout) or slot rows.
    ``kv_blocks_parked`` of the ``kv_blocks_used`` are held by the prefix cache alone: a
    finished request's parked slot (flat layout: ``slots_parked`` of them) or cell blocks
    only its snapshots keep. They are reclaimable, not leaked (the cache drops them when
    a request needs the room: `kv_blocks_reclaimable`), so what running requests hold is
    ``kv_blocks_used - kv_blocks_parked``, which returns to 0 when they have all ended.
    ``pressure_level`` is None without a pressure signal, ``prefix`` None with the prefix
    cache off. ``cancel_bound`` is the declared worst-case cancel→release time beside the
    measured p99 (`Engine.cancel_bound`). ``kv_pool_bytes`` is the pool the plan reserves,
    ``kv_resident_bytes`` what of it is resident: the pages sessions have written."""

    slots_in_use: int
    max_seqs: int
    sessions_by_class: dict[str, int]
    sessions_by_state: dict[str, int]
    kv_blocks_free: int
    kv_blocks_used: int
    kv_pool_bytes: int
    queue_len: int
    admitted: int
    finished: dict[str, int]
    refusals: dict[str, int]
    cancellations: int
    steps: int
    steps_by_batch_size: dict[int, int] = field(default_factory=dict)
    steps_by_class: dict[str, int] = field(default_factory=dict)
    pressure_level: float | None = None
    prefix: PrefixStats | None = None
    cancel_bound: CancelBound | None = None
    kv_resident_bytes: int = 0
    kv_blocks_parked: int = 0
    slots_parked: int = 0
    speculation: SpeculationStats | None = None  # None: the engine does not speculate

    @property
    def kv_blocks_held(self) -> int:
        """KV blocks (or rows) that running requests hold: the used less the parked."""
        return self.kv_blocks_used - self.kv_blocks_parked

    @property
    def kv_blocks_reclaimable(self) -> int:
        """KV blocks (or rows) a new request can have: the free and the parked."""
        return self.kv_blocks_free + self.kv_blocks_parked


def engine_stats(
    pool: KVPool,
    max_seqs: int,
    running: list[Request],
    queued: int,
    counters: EngineCounters,
    *,
    pressure_level: float | None,
    prefix: PrefixStats | None,
    cancel_bound: CancelBound,
    kv_resident_bytes: int,
    speculation: SpeculationStats | None = None,
) -> EngineStats:
    """The engine's `EngineStats`, read under its lock: ``running`` requests, ``queued``
    ones, the pool's occupancy and the engine's ``counters``."""
    usage = pool.usage()
    return EngineStats(
        slots_in_use=len(running),
        max_seqs=max_seqs,
        sessions_by_class=dict(Counter(r.priority for r in running)),
        sessions_by_state=dict(
            Counter("prefill" if r.in_prefill else "decode" for r in running)
            + Counter(queued=queued)
        ),
        kv_blocks_free=usage.free,
        kv_blocks_used=usage.used,
        kv_pool_bytes=pool.nbytes,
        queue_len=queued,
        admitted=counters.admitted,
        finished=dict(counters.finished),
        refusals=dict(counters.refusals),
        cancellations=counters.cancellations,
        steps=sum(counters.steps_by_batch_size.values()),
        steps_by_batch_size=dict(counters.steps_by_batch_size),
        steps_by_class=dict(counters.steps_by_class),
        pressure_level=pressure_level,
        prefix=prefix,
        cancel_bound=cancel_bound,
        kv_resident_bytes=kv_resident_bytes,
        kv_blocks_parked=usage.parked,
        slots_parked=pool.parked_slots,
        speculation=speculation,
    )


@dataclass(frozen=True)
class SlotView:
    """One slot of the pool: ``idle``, or the request it serves (its id, class, prompt and
    generated token counts, and age from submit). An idle slot may be parked
    (``parked_tokens`` not None: a finished request's KV kept for the prefix cache, flat
    layout): still free to take, its KV dropped or reused by the request that takes it."""

    slot: int
    state: SlotState = "idle"
    request_id: int | None = None
    priority: Priority | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    age_s: float = 0.0
    parked_tokens: int | None = None

    def to_dict(self) -> dict[str, object]:
        """The JSON of ``GET /slots``: ``slot`` and ``state``; for a parked idle slot
        ``parked: true`` and ``parked_tokens``; for a busy slot ``request_id``, ``class``,
        ``prompt_tokens``, ``generated_tokens``, ``age_s``."""
        if self.state == "idle" and self.parked_tokens is not None:
            return {
                "slot": self.slot,
                "state": "idle",
                "parked": True,
                "parked_tokens": self.parked_tokens,
            }
        if self.state == "idle":
            return {"slot": self.slot, "state": "idle"}
        return {
            "slot": self.slot,
            "state": self.state,
            "request_id": self.request_id,
            "class": self.priority,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "age_s": self.age_s,
        }


def slot_views(
    pool: KVPool, max_seqs: int, running: Iterable[Request], now: float
) -> list[SlotView]:
    """Each of ``max_seqs`` slots of ``pool``: idle, or the running request bound to it."""
    by_slot = {pool.slot_of(r.request_id): r for r in running}
    return [_slot_view(slot, by_slot.get(slot), now) for slot in range(max_seqs)]


def _slot_view(slot: int, request: Request | None, now: float) -> SlotView:
    if request is None:
        return SlotView(slot)
    return SlotView(
        slot,
        "prefill" if request.in_prefill else "decode",
        request.request_id,
        request.priority,
        len(request.prompt),
        len(request.generated),
        round(now - request.timings.submitted, 3),
    )


@dataclass(frozen=True)
class PoolView:
    """The KV pool as it is held. ``unit`` counts cell blocks (any layer in cells) or slot
    rows; ``total = used + free``. ``sessions`` are the running requests (a session's id is
    its request id), ``snapshots`` the prefix cache's read-only holders; each says exactly
    which blocks (with refcounts) and rows it holds. ``block_size`` is None without cell
    layers; ``row_groups`` are the flat and ring layer groups."""

    layout: str
    unit: PoolUnit
    total: int
    used: int
    free: int
    nbytes: int
    block_size: int | None
    row_groups: tuple[RowGroup, ...]
    sessions: tuple[Holding, ...]
    snapshots: tuple[Holding, ...]


def pool_view(pool: KVPool, layout: str) -> PoolView:
    """``pool``'s occupancy and holdings, read from its own tables (under the engine lock)."""
    usage = pool.usage()
    held = pool.holdings()
    return PoolView(
        layout=layout,
        unit="blocks" if held.block_size is not None else "rows",
        total=usage.free + usage.used,
        used=usage.used,
        free=usage.free,
        nbytes=pool.nbytes,
        block_size=held.block_size,
        row_groups=held.row_groups,
        sessions=held.sessions,
        snapshots=held.snapshots,
    )


def with_parked_slots(slots: list[SlotView], pool: PoolView) -> list[SlotView]:
    """``slots`` (`Engine.slots`) with each idle slot that a prefix-cache snapshot parks in
    ``pool`` (`Engine.pool_view`) marked parked, with the tokens it keeps. The two views are
    read one after the other: a slot that changed hands between them keeps the state
    ``slots`` gave it (a parked mark needs both to agree that no request holds it)."""
    parked = {held.slot: held.length for held in pool.snapshots if held.slot is not None}
    return [
        replace(view, parked_tokens=parked[view.slot])
        if view.state == "idle" and view.slot in parked
        else view
        for view in slots
    ]
