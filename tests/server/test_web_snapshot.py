"""The dashboard's snapshot and feed, without a browser: what a snapshot says about a real
(tiny) engine, the per-class latency samples, the page routes, `--no-web`, the API key,
and the cost of one snapshot."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.kv import KVStore, StepBatch
from slotserve.server import create_app
from slotserve.server.dashboard import (
    ASSETS,
    ClassLatency,
    SnapshotFeed,
    histogram_view,
    kv_view,
)
from slotserve.server.metrics import PrometheusMetrics


class GatedExecutor:
    """Runs a step only when the test ticks; always predicts token 7."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.gate = threading.Semaphore(0)
        self.steps = 0

    def tick(self, steps: int) -> None:
        for _ in range(steps):
            self.gate.release()

    weight_bytes = 0  # weightless: it predicts a constant
    max_step_tokens = None  # any step size

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
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
    wait_for(lambda: executor.steps >= 6)
    snapshot = json.loads(json.dumps(feed.snapshot()))  # JSON as the page gets it

    busy = [slot for slot in snapshot["slots"] if slot["state"] != "idle"]
    assert sorted(slot["class"] for slot in busy) == ["background", "interactive"]
    kv = snapshot["kv"]
    # Each reserved its whole worst case: ceil((prompt + 40) / 16) blocks.
    assert kv["unit"] == "blocks" and kv["used"] == 4 + 3 and kv["total"] == 4 * 128 // 16
    owners = {owner["class"]: owner for owner in kv["owners"]}
    for owner in owners.values():
        assert owner["units"] == -(-owner["tokens"] // 16)  # blocks its written tokens fill
    assert kv["reserved"] == kv["used"] - sum(o["units"] for o in kv["owners"])
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


def test_rows_for_flat_layout(tiny: ss.Model) -> None:
    config = ss.EngineConfig(max_seqs=2, max_context=64, kv_layout="flat")
    with ss.Engine(tiny, config) as engine:
        slots: list[dict[str, object]] = [
            {"slot": 0, "state": "idle"},
            {
                "slot": 1,
                "state": "decode",
                "request_id": 3,
                "class": "normal",
                "prompt_tokens": 10,
                "generated_tokens": 6,
                "age_s": 0.5,
            },
        ]
        kv = kv_view(engine, 1, 1, slots)
    assert kv["unit"] == "rows" and kv["row_cells"] == 64 and kv["total"] == 2
    assert kv["owners"] == [
        {
            "slot": 1,
            "request_id": 3,
            "class": "normal",
            "tokens": 16,
            "units": 1,
            "fill": 16 / 64,
            "wrapped": False,
        }
    ]


def slot(request_id: int, priority: str, generated: int, age: float) -> dict[str, object]:
    return {
        "slot": request_id,
        "state": "decode" if generated else "prefill",
        "request_id": request_id,
        "class": priority,
        "prompt_tokens": 4,
        "generated_tokens": generated,
        "age_s": age,
    }


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
