"""The dashboard's feed: ``GET /dashboard/events``, server-sent events that push a snapshot
of the engine a few times a second to the page (`ops.page`, `server/ops/web/dashboard.js`).

A snapshot is built only from the engine's typed views and what the server already keeps:
`Engine.stats()`, `Engine.slots()`, `Engine.pool_view()` (the pool's own block tables and
rows, so the KV map is the pool as it is held, not an estimate), the memory plan, the
pressure signal, the Prometheus histograms and the stored responses' bytes against their
budget. The feed keeps no engine state of its own;
per connection it remembers only the previous token counts and histogram sums, to turn two
snapshots into rates. Nothing runs when no page is open.

Owns: the snapshot and the feed. Must not touch: the engine's or the pool's internals (it
reads the engine's views only), the page's files, the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from slotserve.engine import Engine, PoolView, SlotView
from slotserve.engine.events import Priority
from slotserve.engine.models import ModelSet
from slotserve.engine.views import with_parked_slots
from slotserve.memory import read_process
from slotserve.server.http.errors import APIError
from slotserve.server.http.security import KeyedRoute, require_api_key
from slotserve.server.http.state import ServerState
from slotserve.server.ops.metrics import PrometheusMetrics
from slotserve.server.responses.store import ResponseStore

# Four snapshots a second: smooth enough to watch tokens stream, cheap (see the report in
# tests/server/test_web_snapshot.py: well under a millisecond each).
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S = 0.05

router = APIRouter(redirect_slashes=False, route_class=KeyedRoute)  # the key from the head


# -- the snapshot ------------------------------------------------------------------------


def histogram_view(histogram: Any) -> dict[str, float | None]:
    """Count, sum, mean and bucket-estimated p50/p95 of a Prometheus histogram."""
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return {
        "count": count,
        "sum": total,
        "mean": total / count if count else None,
        "p50": _bucket_quantile(buckets, count, 0.5),
        "p95": _bucket_quantile(buckets, count, 0.95),
    }


def _bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (Prometheus buckets are
    cumulative); None with no observations or past the last finite bound."""
    if not count:
        return None
    for bound, cumulative in sorted(buckets):
        if cumulative >= q * count:
            return bound if math.isfinite(bound) else None
    return None


def plan_view(engine: Engine) -> dict[str, Any]:
    """The memory plan: arenas, budget (or per-arena map) and the levers."""
    view = engine.plan.to_dict()
    view["kv_pool_bytes"] = engine.pool.nbytes
    return view


def kv_view(pool: PoolView, slots: Iterable[SlotView]) -> dict[str, Any]:
    """The KV pool as it is held, from the pool's own tables (`Engine.pool_view`).

    Each owner (a running request) lists its block table in position order (the real block
    ids; the first ``written`` hold positions it has written, the rest are reserved ahead)
    and its row in each flat or ring group (``rows``, in the order of the pool's ``rows``).
    ``snapshots`` are the prefix cache's holders (a parked one with its ``slot``);
    ``shared`` lists ``[block, refcount]`` for every block more than one table holds
    (copy-on-write); ``reserved`` counts the blocks reserved ahead, ``cached`` the units
    only snapshots hold (blocks, or the rows of parked slots: reclaimable, counted in
    ``used``). ``slots`` give each owner its class (None for one admitted after they were
    read)."""
    classes = {s.request_id: s.priority for s in slots if s.request_id is not None}
    size = pool.block_size
    written = {h.session: math.ceil(h.length / size) if size else 0 for h in pool.sessions}
    owners = [
        {
            "slot": held.slot,
            "request_id": held.session,
            "class": classes.get(held.session),
            "tokens": held.length,
            "capacity": held.capacity,
            "blocks": list(held.blocks),
            "written": written[held.session],
            "rows": [
                {"first": row.first, "live": row.live, "wrapped": row.wrapped} for row in held.rows
            ],
        }
        for held in pool.sessions
    ]
    holders = (*pool.sessions, *pool.snapshots)
    refcounts = {b: n for h in holders for b, n in zip(h.blocks, h.refcounts, strict=True)}
    in_sessions = {b for h in pool.sessions for b in h.blocks}
    ahead = {b for h in pool.sessions for b in h.blocks[written[h.session] :]}
    parked_rows = sum(1 for h in pool.snapshots if h.slot is not None)
    cached = len(refcounts.keys() - in_sessions) if size else parked_rows
    return {
        "unit": pool.unit,
        "layout": pool.layout,
        "block_size": size,
        "rows": [
            {"kind": g.kind, "layers": list(g.layers), "size": g.size} for g in pool.row_groups
        ],
        "total": pool.total,
        "used": pool.used,
        "free": pool.free,
        "reserved": len(ahead),
        "cached": cached,
        "shared": sorted([b, n] for b, n in refcounts.items() if n > 1),
        "owners": owners,
        "snapshots": [
            {"key": h.session, "slot": h.slot, "tokens": h.length, "blocks": list(h.blocks)}
            for h in pool.snapshots
        ],
    }


def pressure_view(engine: Engine, level: float | None) -> dict[str, Any]:
    """The pressure level `Engine.stats` read (None without a signal: serve --pressure)
    against the engine's threshold."""
    source = engine.pressure
    if source is None or level is None:
        return {"level": None, "threshold": None, "under": False}
    return {"level": level, "threshold": source.threshold, "under": level >= source.threshold}


@dataclasses.dataclass
class _Progress:
    """What the feed last saw of one request: its class, when its token count last
    changed, and that count."""

    priority: Priority
    changed_at: float
    generated: int


class ClassLatency:
    """Turns successive `Engine.slots()` views into per-class latency samples.

    ITL: when a request's generated count rises from g0 (at t0, the last change) to g1 at
    t1, the mean gap over those tokens is (t1 - t0) / (g1 - g0); a stall shows up as one
    large sample. TTFT: a request's age (from submit) when its first token is first seen,
    so an upper bound at the feed's resolution (one interval); requests already running
    at the first call give none (their first token may be long past). The exact figures
    of finished requests are the Prometheus histograms, which do not know the class."""

    def __init__(self) -> None:
        self._seen: dict[int, _Progress] = {}
        self._primed = False  # False until the first call

    def observe(self, now: float, slots: Iterable[SlotView]) -> dict[str, dict[str, list[float]]]:
        """Samples since the previous call: ``{"itl": {class: [s]}, "ttft": {class: [s]}}``."""
        samples: dict[str, dict[str, list[float]]] = {"itl": {}, "ttft": {}}
        current: dict[int, _Progress] = {}
        for slot in slots:
            if slot.request_id is None or slot.priority is None:
                continue  # idle
            request_id, generated, priority = slot.request_id, slot.generated_tokens, slot.priority
            before = self._seen.get(request_id)
            progress = before or _Progress(priority, now, 0)
            if generated > progress.generated:
                if progress.generated == 0 and self._primed:
                    samples["ttft"].setdefault(priority, []).append(slot.age_s)
                elif before is not None:
                    gap = (now - progress.changed_at) / (generated - progress.generated)
                    samples["itl"].setdefault(priority, []).append(gap)
                progress = _Progress(priority, now, generated)
            current[request_id] = progress
        self._seen, self._primed = current, True
        return samples


def models_view(models: ModelSet) -> dict[str, Any]:
    """Every model of a served set: its card (state, kind, bytes, loads), its slots and
    queue when loaded, and the device plan's bytes against the budget."""
    cards = models.cards()
    for card in cards:
        engine = models.engine(card["id"])
        if engine is not None and hasattr(engine, "stats"):
            stats = engine.stats()
            card["slots"] = {"in_use": stats.slots_in_use, "max": stats.max_seqs,
                             "queue": stats.queue_len}  # fmt: skip
    return {"cards": cards, "used": models.used_bytes, "budget": models.budget}


class SnapshotFeed:
    """One page's view of the engine. Builds JSON-ready snapshots; remembers only the
    previous token counts (`ClassLatency`) and the cancel histogram's totals."""

    def __init__(
        self,
        engine: Engine,
        metrics: PrometheusMetrics | None,
        model: str,
        models: ModelSet | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        self.engine, self.metrics, self.model = engine, metrics, model
        self.models = models  # a served set: every model's state beside the first's view
        self.responses = responses  # the Responses API's stored responses
        self.latency = ClassLatency()
        # The plan changes only when the ledger gains an arena (the server's start); its
        # levers take a search, so it is built again only then.
        self._plan: tuple[int, dict[str, Any]] | None = None
        self._cancels = (0.0, 0.0)  # (count, sum) of the cancel→release histogram

    def _plan_view(self) -> dict[str, Any]:
        entries = len(self.engine.ledger.entries)
        if self._plan is None or self._plan[0] != entries:
            self._plan = (entries, plan_view(self.engine))
        return self._plan[1]

    def snapshot(self) -> dict[str, Any]:
        """The engine now, JSON-ready: stats, slots, the KV map, plan, pressure, the latency
        samples since the previous snapshot and the histograms."""
        began = time.perf_counter()
        engine = self.engine
        stats = engine.stats()
        pool = engine.pool_view()
        slots = with_parked_slots(engine.slots(), pool)
        now = engine.clock()
        snapshot: dict[str, Any] = {
            "type": "snapshot",
            "t": now,
            "model": self.model,
            "closed": engine.closed,
            "policy": engine.config.policy,
            "stats": dataclasses.asdict(stats),
            "slots": [slot.to_dict() for slot in slots],
            "kv": kv_view(pool, slots),
            "plan": self._plan_view(),
            "memory": read_process().to_dict(),
            "pressure": pressure_view(engine, stats.pressure_level),
            "samples": self.latency.observe(now, slots),
            "latency": self._latency(),
        }
        if self.models is not None:
            snapshot["models"] = models_view(self.models)
        if self.responses is not None:
            snapshot["responses"] = self.responses.view()
        snapshot["build_ms"] = (time.perf_counter() - began) * 1e3
        return snapshot

    def _latency(self) -> dict[str, Any]:
        """The Prometheus histograms (all classes, requests that ended), and the mean
        cancel→release latency of the cancellations since the previous snapshot."""
        if self.metrics is None:
            return {}
        metrics = self.metrics
        views: dict[str, Any] = {
            "ttft": histogram_view(metrics.ttft),
            "itl": histogram_view(metrics.itl),
            "queue": histogram_view(metrics.queue),
            "cancel": histogram_view(metrics.cancel),
        }
        cancel = views["cancel"]
        count, total = float(cancel["count"] or 0), float(cancel["sum"] or 0)
        new = count - self._cancels[0]
        views["cancel_recent"] = (total - self._cancels[1]) / new if new > 0 else None
        self._cancels = (count, total)
        return views


# -- the feed ----------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _ended(state: ServerState) -> bool:
    return state.shutting_down or state.engine is None or state.engine.closed


async def _events(request: Request, feed: SnapshotFeed, interval: float) -> AsyncIterator[str]:
    """Snapshots as SSE ``data:`` lines until the client leaves or the server shuts down
    (an open page must not hold up the shutdown)."""
    state = _state(request)
    while not _ended(state):
        yield f"data: {json.dumps(feed.snapshot())}\n\n"
        await asyncio.sleep(interval)
        if await request.is_disconnected():
            return
    yield 'data: {"type": "closed"}\n\n'


@router.get("/dashboard/events", dependencies=[Depends(require_api_key)])
async def dashboard_events(request: Request, interval: float = DEFAULT_INTERVAL_S) -> Response:
    """The dashboard's feed: one engine snapshot every ``interval`` seconds (SSE)."""
    state = _state(request)
    if state.engine is None:
        raise APIError(503, "the model is not ready (still loading)", "server_error")
    feed = SnapshotFeed(
        state.engine, state.metrics, state.model_name, state.models, state.responses
    )
    pace = max(MIN_INTERVAL_S, interval)
    return StreamingResponse(
        _events(request, feed, pace),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
