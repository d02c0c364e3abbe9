"""The web page at ``/`` and the one server-sent-events feed that keeps its dashboard live.

The page is plain static files (`server/web/`: HTML, CSS, JS, no build step) served from the
package. Its chat panel talks to the server's own OpenAI endpoints; its dashboard reads
``GET /dashboard/events``, which pushes a snapshot of the engine a few times a second.

A snapshot is built only from what the engine and the server already keep: `Engine.stats()`,
`Engine.slots()`, the memory plan, the pressure signal and the Prometheus histograms. The
feed keeps no engine state of its own; per connection it remembers only the previous
token counts and histogram sums, to turn two snapshots into rates. Nothing runs when no
page is open.

Owns: the page and asset routes, the snapshot and the feed. Must not touch: the engine's
or the pool's internals (it reads the public API only), the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Iterable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from slotserve.engine import Engine
from slotserve.kv.placement import cells_per_session, layer_rules
from slotserve.server.errors import APIError
from slotserve.server.metrics import PrometheusMetrics
from slotserve.server.security import require_api_key
from slotserve.server.state import ServerState

# Four snapshots a second: smooth enough to watch tokens stream, cheap (see the report in
# tests/server/test_web_snapshot.py: well under a millisecond each).
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S = 0.05

# The page's files and their media types; nothing else under web/ is served.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "sse.js": "text/javascript; charset=utf-8",
}

router = APIRouter(redirect_slashes=False)


# -- the page ----------------------------------------------------------------------------


def _asset(name: str) -> Response:
    """One of the page's files, read from the installed package."""
    if name not in ASSETS:
        raise APIError(404, f"no such file: {name}", "invalid_request_error")
    body = resources.files("slotserve.server").joinpath("web", name).read_bytes()
    # no-cache: the page is small and a restarted server may serve a newer one.
    return Response(body, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def page() -> Response:
    """The page itself. Open without a key: it holds no data, and asks for the key."""
    return _asset("index.html")


@router.get("/web/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    return _asset(name)


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


def row_cells(engine: Engine) -> int:
    """Positions one session's row holds (flat: max_context; ring: its window + sinks),
    the longest over the layers' placement rules."""
    kv = engine.plan.kv
    return max(cells_per_session(rule, kv) for rule in layer_rules(engine.plan.info, kv))


def kv_view(engine: Engine, used: int, free: int, slots: list[dict[str, object]]) -> dict[str, Any]:
    """The KV pool as its owners hold it, from token counts and the pool's usage.

    The engine does not publish block tables, so each owner's share is estimated as the
    blocks (or row positions) its written tokens fill; cell blocks reserved ahead for tokens
    not yet generated are counted, unattributed, as ``reserved``."""
    kv = engine.plan.kv
    cell = kv.layout == "cell"
    size = kv.block_size if cell else row_cells(engine)
    owners: list[dict[str, Any]] = []
    for slot in slots:
        if slot["state"] == "idle":
            continue
        tokens = _int(slot["prompt_tokens"]) + _int(slot["generated_tokens"])
        owners.append(
            {
                "slot": slot["slot"],
                "request_id": slot["request_id"],
                "class": slot["class"],
                "tokens": tokens,
                "units": math.ceil(tokens / size) if cell else 1,
                "fill": min(tokens, size) / size,
                "wrapped": not cell and tokens > size,
            }
        )
    written = sum(o["units"] for o in owners) if cell else 0
    return {
        "unit": "blocks" if cell else "rows",
        "layout": kv.layout,
        "block_size": kv.block_size if cell else None,
        "row_cells": None if cell else size,
        "total": used + free,
        "used": used,
        "free": free,
        "reserved": max(0, used - written) if cell else 0,
        "owners": owners,
    }


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


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

    priority: str
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

    def observe(
        self, now: float, slots: Iterable[dict[str, object]]
    ) -> dict[str, dict[str, list[float]]]:
        """Samples since the previous call: ``{"itl": {class: [s]}, "ttft": {class: [s]}}``."""
        samples: dict[str, dict[str, list[float]]] = {"itl": {}, "ttft": {}}
        current: dict[int, _Progress] = {}
        for slot in slots:
            if slot["state"] == "idle":
                continue
            request_id, generated = _int(slot["request_id"]), _int(slot["generated_tokens"])
            priority = str(slot["class"])
            before = self._seen.get(request_id)
            progress = before or _Progress(priority, now, 0)
            if generated > progress.generated:
                if progress.generated == 0 and self._primed:
                    age = _float(slot["age_s"])
                    samples["ttft"].setdefault(priority, []).append(age)
                elif before is not None:
                    gap = (now - progress.changed_at) / (generated - progress.generated)
                    samples["itl"].setdefault(priority, []).append(gap)
                progress = _Progress(priority, now, generated)
            current[request_id] = progress
        self._seen, self._primed = current, True
        return samples


class SnapshotFeed:
    """One page's view of the engine. Builds JSON-ready snapshots; remembers only the
    previous token counts (`ClassLatency`) and the cancel histogram's totals."""

    def __init__(self, engine: Engine, metrics: PrometheusMetrics | None, model: str) -> None:
        self.engine, self.metrics, self.model = engine, metrics, model
        self.latency = ClassLatency()
        self._plan = plan_view(engine)  # fixed for the engine's life; its levers take a search
        self._cancels = (0.0, 0.0)  # (count, sum) of the cancel→release histogram

    def snapshot(self) -> dict[str, Any]:
        began = time.perf_counter()
        engine = self.engine
        stats = engine.stats()
        slots = engine.slots()
        now = engine.clock()
        snapshot: dict[str, Any] = {
            "type": "snapshot",
            "t": now,
            "model": self.model,
            "closed": engine.closed,
            "policy": engine.config.policy,
            "stats": dataclasses.asdict(stats),
            "slots": slots,
            "kv": kv_view(engine, stats.kv_blocks_used, stats.kv_blocks_free, slots),
            "plan": self._plan,
            "pressure": pressure_view(engine, stats.pressure_level),
            "samples": self.latency.observe(now, slots),
            "latency": self._latency(),
        }
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
    feed = SnapshotFeed(state.engine, state.metrics, state.model_name)
    pace = max(MIN_INTERVAL_S, interval)
    return StreamingResponse(
        _events(request, feed, pace),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
