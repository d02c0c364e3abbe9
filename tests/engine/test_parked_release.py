"""Parked KV is reported apart from what requests hold (issue 52, item 3).

With the prefix cache on, a finished or cancelled request leaves its KV to the cache: the
flat layout parks its slot (rows in place), the cell layout keeps its blocks in a snapshot,
the ring layout copies its rows out of the pool. None of it is a leak: ``kv_blocks_used``
counts it, ``kv_blocks_parked`` says how much of the used it is (reclaimable: the next
request that needs the room takes it), and ``used - parked`` returns to its baseline after a
cancel and after a dropped handle on every layout. ``/slots``, ``/metrics`` and the
dashboard's feed say the same."""

from __future__ import annotations

import gc
import json
import re
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.engine.views import with_parked_slots
from slotserve.server import create_app
from slotserve.server.ops.dashboard import SnapshotFeed

LONG = ss.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
SHORT = ss.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
LAYOUTS = ["flat", "cell", "ring"]


def cached_engine(make_engine: Any, layout: str, max_seqs: int = 2) -> ss.Engine:
    engine: ss.Engine = make_engine(
        max_seqs=max_seqs,
        max_context=256,
        kv_layout=layout,
        ring_window=64,
        prefix_cache_bytes="1MiB",
    )
    return engine


def held(engine: ss.Engine) -> int:
    """What running requests hold: the used less the parked."""
    stats = engine.stats()
    assert stats.kv_blocks_held == stats.kv_blocks_used - stats.kv_blocks_parked
    return stats.kv_blocks_held


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_used_less_parked_returns_to_baseline_after_a_cancel(make_engine: Any, layout: str) -> None:
    engine = cached_engine(make_engine, layout)
    baseline = held(engine)
    handle = engine.submit([5, 6, 7], LONG)
    events = iter(handle)
    for _ in range(5):
        next(events)
    assert held(engine) > baseline
    handle.cancel(wait=True)
    stats = engine.stats()
    assert stats.slots_in_use == 0 and held(engine) == baseline
    # The cache kept the cancelled request's KV: in the pool (parked) for flat and cell;
    # copied out of it for a ring, whose pool then holds nothing.
    assert stats.prefix is not None and stats.prefix.snapshots == 1
    if layout == "ring":
        assert (stats.kv_blocks_used, stats.kv_blocks_parked) == (0, 0)
    else:
        assert stats.kv_blocks_used == stats.kv_blocks_parked > 0
    assert stats.slots_parked == (1 if layout == "flat" else 0)
    assert stats.kv_blocks_reclaimable == stats.kv_blocks_free + stats.kv_blocks_parked
    engine.check_integrity()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_used_less_parked_returns_to_baseline_after_a_dropped_handle(
    make_engine: Any, layout: str
) -> None:
    engine = cached_engine(make_engine, layout)
    baseline = held(engine)
    handle = engine.submit([5, 6, 7], LONG)
    next(iter(handle))
    del handle
    gc.collect()
    wait_until(lambda: engine.stats().slots_in_use == 0)
    stats = engine.stats()
    assert held(engine) == baseline and stats.cancellations == 1
    assert stats.kv_blocks_parked == (0 if layout == "ring" else stats.kv_blocks_used)
    engine.check_integrity()


@pytest.mark.parametrize("layout", ["flat", "cell"])
def test_parked_kv_is_reclaimed_by_the_next_request(make_engine: Any, layout: str) -> None:
    """One slot, parked (flat) or one pool's worth of cached blocks (cell): a request that
    shares nothing with them is admitted all the same, taking the parked room."""
    engine = make_engine(
        max_seqs=1, max_context=64, kv_layout=layout, num_blocks=4, prefix_cache_bytes="1MiB"
    )
    fill = ss.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    engine.submit([5, 6, 7], fill, publish_completion=True).result()  # all 43 positions
    before = engine.stats()
    assert before.kv_blocks_parked > 0 and before.kv_blocks_held == 0
    assert before.kv_blocks_free < 3  # a second such request needs the parked room
    handle = engine.submit([90, 91, 92], fill)
    next(iter(handle))
    during = engine.stats()
    assert during.slots_in_use == 1 and during.refusals == {}
    assert during.kv_blocks_held > 0
    handle.cancel(wait=True)
    engine.check_integrity()


def test_blocks_a_running_request_shares_with_a_snapshot_are_not_parked(
    make_engine: Any,
) -> None:
    """Cell blocks that a snapshot and a running request both hold are the request's (in
    use); only those the cache alone holds are parked."""
    engine = make_engine(
        max_seqs=2, max_context=256, kv_layout="cell", block_size=8, prefix_cache_bytes="1MiB"
    )
    system = list(range(20, 45))  # 25 tokens: three whole blocks of 8
    engine.submit([*system, 1], SHORT).result()
    parked = engine.stats().kv_blocks_parked
    assert parked == engine.stats().kv_blocks_used > 0
    handle = engine.submit([*system, 2], LONG)  # restores the system prompt's blocks
    next(iter(handle))
    stats = engine.stats()
    assert stats.prefix is not None and stats.prefix.hits == 1
    with engine._lock:  # one moment: the request's prompt may publish a snapshot meanwhile
        usage = engine.pool.usage()
        sessions = set(engine.pool.sessions[handle.request_id].table)
        snapshots = {b for frozen in engine.pool.snapshots.values() for b in frozen.table}
    shared = sessions & snapshots
    assert len(shared) >= 3
    assert usage.parked == len(snapshots - sessions)  # the shared blocks are in use
    assert stats.kv_blocks_held == stats.kv_blocks_used - stats.kv_blocks_parked
    handle.cancel(wait=True)
    assert held(engine) == 0


# -- what readers see: /slots, /metrics, the dashboard ---------------------------------


def gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return None if match is None else float(match.group(1))


def test_slots_metrics_and_the_dashboard_report_parked_slots(make_engine: Any) -> None:
    engine = cached_engine(make_engine, "flat", max_seqs=3)
    engine.submit([5, 6, 7], SHORT).result()  # finished: its slot is parked
    running = engine.submit([40, 41], LONG)
    next(iter(running))
    client = TestClient(create_app(engine, "tiny", web=False))

    slots = client.get("/slots")
    assert slots.status_code == 200
    by_state = [(s["state"], s.get("parked", False)) for s in slots.json()]
    assert sorted(by_state) == [("decode", False), ("idle", False), ("idle", True)]
    (parked,) = [s for s in slots.json() if s.get("parked")]
    assert parked["parked_tokens"] == 3 + 4 - 1  # the prompt and the fed replies
    assert slots.headers["x-kv-blocks-parked"] == "1"
    assert slots.headers["x-slots-parked"] == "1"
    assert slots.headers["x-kv-blocks-used"] == "2"

    text = client.get("/metrics").text
    assert gauge(text, "slotserve_kv_blocks_used") == 2
    assert gauge(text, "slotserve_kv_blocks_parked") == 1
    assert gauge(text, "slotserve_slots_parked") == 1
    assert gauge(text, "slotserve_kv_blocks_reclaimable") == 1 + 1  # one free, one parked

    snapshot = json.loads(json.dumps(SnapshotFeed(engine, None, "tiny").snapshot()))
    assert snapshot["stats"]["kv_blocks_parked"] == 1
    assert snapshot["stats"]["slots_parked"] == 1
    assert snapshot["kv"]["cached"] == 1 and snapshot["kv"]["used"] == 2
    assert [s["slot"] for s in snapshot["kv"]["snapshots"]] == [parked["slot"]]
    assert [s for s in snapshot["slots"] if s.get("parked")] == [parked]

    running.cancel(wait=True)
    after = client.get("/slots")
    assert after.headers["x-kv-blocks-parked"] == after.headers["x-kv-blocks-used"] == "2"
    assert all(s["state"] == "idle" for s in after.json())


def test_a_slot_that_changed_hands_keeps_the_state_slots_gave() -> None:
    """`with_parked_slots` marks only idle slots a snapshot parks: a busy slot stays busy,
    whatever the pool view (read a moment later) says."""
    from slotserve.engine.views import PoolView, SlotView
    from slotserve.kv.holdings import Holding

    frozen = Holding(session=7, slot=1, length=9, capacity=9, blocks=(), refcounts=(), rows=())
    pool = PoolView("flat", "rows", 3, 1, 2, 0, None, (), (), (frozen,))
    views = [SlotView(0), SlotView(1), SlotView(2, "decode", 4, "normal", 3, 1, 0.1)]
    marked = with_parked_slots(views, pool)
    assert [v.parked_tokens for v in marked] == [None, 9, None]
    busy = with_parked_slots([SlotView(1, "prefill", 8, "normal", 3, 0, 0.0)], pool)
    assert busy[0].parked_tokens is None and busy[0].to_dict()["state"] == "prefill"
