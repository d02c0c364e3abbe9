"""The dashboard's snapshot and feed, without a browser: what a snapshot says about a real
(tiny) engine, its KV map against the pool's own block tables and rows (flat, ring, cell
with shared prefix blocks, and a sliding-window model), the per-class latency samples, the
page routes, `--no-web`, the API key, and the cost of one snapshot."""

from __future__ import annotations

import ast
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.engine import SlotView
from slotserve.engine.events import Priority
from slotserve.kv import KVStore, StepBatch
from slotserve.server import create_app
from slotserve.server.ops import dashboard
from slotserve.server.ops.dashboard import ClassLatency, SnapshotFeed, histogram_view
from slotserve.server.ops.metrics import PrometheusMetrics
from slotserve.server.ops.page import ASSETS
from slotserve.server.responses.store import ResponseStore, StoredResponse


class GatedExecutor:
    """Runs a step only when the test ticks; always predicts token 7."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.gate = threading.Semaphore(0)
        self.steps = 0
        self.arrived = 0  # steps that reached the gate (committed in the pool), run or not

    def tick(self, steps: int) -> None:
        for _ in range(steps):
            self.gate.release()

    weight_bytes = 0  # weightless: it predicts a constant
    max_step_tokens = None  # any step size

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        self.arrived += 1
        assert self.gate.acquire(timeout=10), "test did not tick"
        self.steps += 1
        logits = torch.zeros(batch.size, self.vocab)
        logits[:, 7] = 1.0
        return logits


@pytest.fixture
def gated(tiny: ss.Model) -> Iterator[tuple[ss.Engine, GatedExecutor]]:
    executor = GatedExecutor(tiny.info.vocab_size)
    config = ss.EngineConfig(max_seqs=4, max_context=128, kv_layout="cell", block_size=16)
    engine = ss.Engine(tiny, config, executor=executor)
    yield engine, executor
    executor.tick(1000)  # nothing may wait on the gate while the engine closes
    engine.close()
    engine.check_integrity()


def wait_for(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


PARAMS = ss.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


def test_snapshot_shows_busy_slots_owners_and_freed_blocks(
    gated: tuple[ss.Engine, GatedExecutor],
) -> None:
    engine, executor = gated
    metrics = PrometheusMetrics(engine.stats)
    engine.on_finished = metrics.observe
    feed = SnapshotFeed(engine, metrics, "tiny")
    chat = engine.submit(list(range(10, 30)), PARAMS, priority="interactive")  # 20 tokens
    job = engine.submit(list(range(10, 15)), PARAMS, priority="background")  # 5 tokens
    executor.tick(6)
    # The seventh step committed and waiting at the gate: nothing moves while the test
    # reads the snapshot and then the pool (after the sixth began, the engine still ends
    # it and commits the seventh).
    wait_for(lambda: executor.arrived > 6)
    snapshot = json.loads(json.dumps(feed.snapshot()))  # JSON as the page gets it

    busy = [slot for slot in snapshot["slots"] if slot["state"] != "idle"]
    assert sorted(slot["class"] for slot in busy) == ["background", "interactive"]
    kv = snapshot["kv"]
    # Each reserved its whole worst case: ceil((prompt + 40) / 16) blocks.
    assert kv["unit"] == "blocks" and kv["used"] == 4 + 3 and kv["total"] == 4 * 128 // 16
    owners = {owner["class"]: owner for owner in kv["owners"]}
    assert [len(owners[c]["blocks"]) for c in ("interactive", "background")] == [4, 3]
    for owner in owners.values():
        assert owner["tokens"] == engine.pool.length(owner["request_id"])
        assert owner["written"] == -(-owner["tokens"] // 16)  # blocks its written tokens fill
    assert kv["reserved"] == kv["used"] - sum(o["written"] for o in kv["owners"])
    assert snapshot["plan"]["arenas"]["kv"] == engine.pool.nbytes
    assert snapshot["stats"]["slots_in_use"] == 2

    job.cancel()
    chat.cancel()
    executor.tick(2)  # the step in flight ends; the cancels land at its boundary
    job.cancel(wait=True, timeout=10)
    chat.cancel(wait=True, timeout=10)
    after = feed.snapshot()
    assert after["kv"]["used"] == 0 and after["kv"]["owners"] == []
    assert all(slot["state"] == "idle" for slot in after["slots"])
    assert after["stats"]["cancellations"] == 2
    assert after["latency"]["cancel"]["count"] == 2
    assert after["latency"]["cancel_recent"] is not None  # both cancels since the last one


def test_pressure_level_from_stats(tiny: ss.Model) -> None:
    config = ss.EngineConfig(max_seqs=1, max_context=64)
    with ss.Engine(tiny, config, pressure=ss.PressureSource(lambda: 1.5)) as engine:
        assert SnapshotFeed(engine, None, "tiny").snapshot()["pressure"] == {
            "level": 1.5,
            "threshold": 1.0,
            "under": True,
        }
    with ss.Engine(tiny, config) as engine:
        assert SnapshotFeed(engine, None, "tiny").snapshot()["pressure"]["level"] is None


def test_snapshot_shows_the_stored_responses_against_their_budget(tiny: ss.Model) -> None:
    store = ResponseStore(size=4, budget_bytes=1 << 20)
    assert store.put("resp_1", StoredResponse([{"role": "user", "content": "hi"}], {"id": "1"}))
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=1, max_context=64)) as engine:
        assert "responses" not in SnapshotFeed(engine, None, "tiny").snapshot()
        view = SnapshotFeed(engine, None, "tiny", responses=store).snapshot()["responses"]
    assert view == {"stored": 1, "size": 4, "held_bytes": store.held_bytes, "budget_bytes": 1 << 20}
    assert 0 < store.held_bytes < 1 << 20


def cells_of(engine: ss.Engine, layers: list[int], request_id: int) -> set[int]:
    """The cells the pool's own placement gives a session's live positions in the layer
    group of ``layers``."""
    pool = engine.pool
    (group,) = [g for g in pool.groups if g.layers == layers]
    bound = pool.sessions[request_id]
    return set(group.cell_index(bound, torch.arange(bound.length)).tolist())


def assert_map_is_the_pools(engine: ss.Engine, kv: dict[str, Any]) -> None:
    """The feed's KV map is the pool's own tables: every session's block table and rows,
    every snapshot's blocks, every refcount above 1, and nothing else in use."""
    pool = engine.pool
    owners = {owner["request_id"]: owner for owner in kv["owners"]}
    assert set(owners) == set(pool.sessions)
    for request_id, bound in pool.sessions.items():
        owner = owners[request_id]
        assert (owner["slot"], owner["tokens"]) == (bound.slot, bound.length)
        assert owner["blocks"] == bound.table
        for group, row in zip(kv["rows"], owner["rows"], strict=True):
            cells = set(range(row["first"], row["first"] + row["live"]))
            assert cells == cells_of(engine, group["layers"], request_id)
    snapshots = {snapshot["key"]: snapshot["blocks"] for snapshot in kv["snapshots"]}
    assert snapshots == {key: frozen.table for key, frozen in pool.snapshots.items()}
    refcount = pool.blocks.refcount
    assert kv["shared"] == [[b, n] for b, n in enumerate(refcount) if n > 1]
    held = {b for o in kv["owners"] for b in o["blocks"]} | {
        b for blocks in snapshots.values() for b in blocks
    }
    assert held == {b for b, n in enumerate(refcount) if n > 0}
    assert kv["used"] == (len(held) if kv["unit"] == "blocks" else len(pool.sessions))
    assert kv["used"] + kv["free"] == kv["total"]
    assert [(g["kind"], g["layers"], g["size"]) for g in kv["rows"]] == [
        (g.kind, g.layers, g.n_cells // engine.config.max_seqs)
        for g in pool.groups
        if g.kind != "cell"
    ]


SYSTEM = list(range(20, 41))  # 21 tokens: two blocks of 8 and part of a third


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("llama", "cell"), ("llama", "flat"), ("llama", "ring"), ("mixed", "cell")],
)
def test_the_kv_map_is_the_pools_own_tables(
    kind: str, layout: str, tiny_dirs: dict[str, Path]
) -> None:
    """No module computes what the pool already knows: the map the page draws is the pool's
    block tables (cell: the real ids, blocks shared copy-on-write with a prefix snapshot,
    their refcounts) and rows (flat; ring, wrapped; a sliding-window model's rings)."""
    model = ss.load(tiny_dirs[kind])
    executor = GatedExecutor(model.info.vocab_size)
    cached = layout != "flat"  # the prefix cache needs cells or rings
    config = ss.EngineConfig(
        max_seqs=3,
        max_context=128,
        kv_layout=layout,
        block_size=8,
        ring_window=12,
        sinks=2,
        policy="fifo",  # both requests in every step
        prefix_cache_bytes="1MiB" if cached else 0,
    )
    engine = ss.Engine(model, config, executor=executor)
    try:
        feed = SnapshotFeed(engine, None, "tiny")
        first = engine.submit([*SYSTEM, 1], PARAMS, priority="interactive")
        # Its prefill (then published to the cache) and two decodes; the engine commits a
        # step in the pool before running it, so the third decode is committed, waiting.
        executor.tick(3)
        wait_for(lambda: engine.pool.length(0) == len(SYSTEM) + 1 + 3)
        second = engine.submit([*SYSTEM, 2], PARAMS, priority="background")
        kv = json.loads(json.dumps(feed.snapshot()["kv"]))  # JSON as the page gets it
        assert_map_is_the_pools(engine, kv)
        owners = {owner["request_id"]: owner for owner in kv["owners"]}
        assert [owners[i]["class"] for i in (0, 1)] == ["interactive", "background"]
        if layout == "cell":  # the second restored the system prompt's blocks: shared
            assert kv["snapshots"] and kv["cached"] == 0
            assert {b for b, _ in kv["shared"]} >= set(engine.pool.sessions[1].table[:2])
        if layout == "ring":  # 25 positions in a ring of 2 sinks + 12: wrapped
            assert owners[0]["rows"][0]["wrapped"]
        executor.tick(2)  # the second's first step copies the shared block it writes
        wait_for(lambda: engine.pool.length(1) == len(SYSTEM) + 1 + 1)
        assert_map_is_the_pools(engine, feed.snapshot()["kv"])
        for handle in (first, second):
            handle.cancel()
        executor.tick(2)
        for handle in (first, second):
            handle.cancel(wait=True, timeout=10)
        after = feed.snapshot()["kv"]
        assert_map_is_the_pools(engine, after)
        assert after["owners"] == [] and bool(after["snapshots"]) == cached
    finally:
        executor.tick(1000)
        engine.close()
        engine.check_integrity()


def test_the_feed_imports_no_kv_internals() -> None:
    """The feed reads the engine's views; it has no KV placement rules to compute with."""
    tree = ast.parse(Path(dashboard.__file__).read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in modules if m.startswith("slotserve.kv")]


def slot(request_id: int, priority: Priority, generated: int, age: float) -> SlotView:
    state = "decode" if generated else "prefill"
    return SlotView(request_id, state, request_id, priority, 4, generated, age)


def test_class_latency_samples() -> None:
    latency = ClassLatency()
    assert latency.observe(0.0, [slot(1, "interactive", 0, 0.1)]) == {"itl": {}, "ttft": {}}
    # The first token is seen at age 0.35: a TTFT sample (an upper bound, one interval).
    assert latency.observe(0.25, [slot(1, "interactive", 2, 0.35)])["ttft"] == {
        "interactive": [0.35]
    }
    # Stalled for an interval, then 3 tokens: (1.0 - 0.25) / 3 each.
    assert latency.observe(0.5, [slot(1, "interactive", 2, 0.6)]) == {"itl": {}, "ttft": {}}
    samples = latency.observe(1.0, [slot(1, "interactive", 5, 1.1), slot(2, "background", 3, 2)])
    assert samples["itl"] == {"interactive": [pytest.approx(0.25)]}
    assert samples["ttft"] == {"background": [2.0]}  # first seen with tokens already
    # A request that left is forgotten.
    latency.observe(1.25, [])
    assert latency.observe(1.5, [slot(1, "interactive", 7, 1.6)])["ttft"] == {"interactive": [1.6]}
    # A page opened while a request runs gives it no TTFT: its first token may be long past.
    assert ClassLatency().observe(9.0, [slot(4, "normal", 50, 8.0)])["ttft"] == {}


def test_histogram_view_bucket_quantiles(tiny: ss.Model) -> None:
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=1, max_context=64)) as engine:
        metrics = PrometheusMetrics(engine.stats)
    for value in (0.004, 0.004, 0.02, 0.3):
        metrics.itl.observe(value)
    view = histogram_view(metrics.itl)
    assert view["count"] == 4 and view["mean"] == pytest.approx(0.082)
    assert view["p50"] == 0.005 and view["p95"] == 0.5
    assert histogram_view(metrics.ttft)["p50"] is None


def test_page_routes_key_and_no_web(tiny: ss.Model) -> None:
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=1, max_context=64)) as engine:
        client = TestClient(create_app(engine, "tiny", api_key="k"))
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for name, media in ASSETS.items():
            asset = client.get(f"/web/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == media, name
        assert client.get("/web/dashboard.py").status_code == 404
        assert client.get("/web/..%2Fdashboard.py").status_code == 404
        assert client.get("/dashboard/events").status_code == 401  # the feed needs the key

        bare = TestClient(create_app(engine, "tiny", web=False))
        assert bare.get("/").status_code == 404
        assert bare.get("/web/app.js").status_code == 404
        assert bare.get("/dashboard/events").status_code == 404
        assert bare.get("/health").status_code == 200


def test_feed_streams_snapshots_and_ends_at_shutdown(tiny: ss.Model) -> None:
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=2, max_context=64)) as engine:
        app = create_app(engine, "tiny", api_key="k")
        client = TestClient(app)
        headers = {"Authorization": "Bearer k"}
        with client.stream("GET", "/dashboard/events?interval=0.05", headers=headers) as feed:
            assert feed.headers["content-type"].startswith("text/event-stream")
            events = (line for line in feed.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events).removeprefix("data: "))
            assert first["type"] == "snapshot" and first["stats"]["max_seqs"] == 2
            app.state.server.stop_admitting()  # an open page must not hold up a shutdown
            rest = [json.loads(line.removeprefix("data: ")) for line in events]
        assert rest[-1] == {"type": "closed"}


def test_snapshot_cost(tiny: ss.Model, capsys: pytest.CaptureFixture[str]) -> None:
    """Time per snapshot with every slot busy (reported; bounded loosely for slow CI)."""
    executor = GatedExecutor(tiny.info.vocab_size)
    config = ss.EngineConfig(max_seqs=8, max_context=256, kv_layout="cell")
    engine = ss.Engine(tiny, config, executor=executor)
    try:
        metrics = PrometheusMetrics(engine.stats)
        handles = [engine.submit([10, 11, 12], PARAMS) for _ in range(8)]
        executor.tick(3)
        feed = SnapshotFeed(engine, metrics, "tiny")
        feed.snapshot()
        runs = 200
        began = time.perf_counter()
        for _ in range(runs):
            json.dumps(feed.snapshot())
        per_snapshot_ms = (time.perf_counter() - began) / runs * 1e3
        with capsys.disabled():
            print(f"\nsnapshot + JSON, 8 busy slots: {per_snapshot_ms:.3f} ms")
        assert per_snapshot_ms < 20
        for handle in handles:
            handle.cancel()
    finally:
        executor.tick(1000)
        engine.close()
