"""The disk tier's faults under load, each fixed and pinned here: a handle dropped on a
thread that holds the store's lock (a garbage-collection pass on the writer) is reclaimed
without taking the engine lock, which deadlocked the server; a store that starts empty
restores on first use (an empty store is falsy, and its restore thread was never made);
a FIFO, a device, a directory or a symbolic link named like a snapshot is refused, never
opened (a FIFO blocked the start forever); only snapshots likely to be used again are
written, long enough and within a write rate; a disk read re-admitted from the queue holds
neither the engine lock nor a cancel of its request."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.prefix import store as store_module
from slotserve.prefix.store_file import StoreEntry
from tests.engine.test_exactness import trace
from tests.engine.test_prefix_store_engine import (
    CELL,
    GREEDY,
    USER_TURNS,
    converse,
    engines,
    exact,
    store_stats,
)

__all__ = ["engines", "exact"]  # fixtures, used by name

LONG = ss.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
SYSTEM = [5 + (i * 37) % 200 for i in range(40)]


def stored(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {**CELL, "prefix_cache_bytes": "4MiB", "prefix_store": tmp_path, **more}


def store_of(engine: ss.Engine) -> store_module.PrefixStore:
    assert engine.prefix is not None and engine.prefix.store is not None
    return engine.prefix.store


def only_on_disk(engine: ss.Engine) -> None:
    """Write what is queued, then drop every snapshot from memory."""
    store_of(engine).flush()
    assert engine.prefix is not None
    with engine._lock:
        while engine.prefix.evict_one():
            pass


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_handle_dropped_under_the_store_lock_takes_no_engine_lock(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    """The deadlock's cycle: the writer holds the store lock when a collection runs a
    dropped handle's finalizer on it, while the engine thread holds the engine lock and
    waits for the store's. The finalizer must return at once whoever holds the engine lock."""
    engine = engines(exact, **stored(tmp_path))
    store = store_of(engine)
    holder = [engine.submit([5, 6, 7], LONG)]
    wait_for(lambda: engine.stats().slots_in_use == 1)
    dropped = threading.Event()

    def drop_on_the_writer() -> None:
        with store._lock:  # as the writer holds it while it indexes a file
            holder.pop()  # the last reference: its finalizer runs here, on this thread
            gc.collect()
            dropped.set()

    with engine._lock:  # as the engine thread holds it, waiting for the store's
        dropper = threading.Thread(target=drop_on_the_writer, daemon=True)
        dropper.start()
        assert dropped.wait(5.0), "a dropped handle's finalizer waited for the engine lock"
    dropper.join(5.0)
    wait_for(lambda: engine.stats().slots_in_use == 0)  # reclaimed at the next boundary
    stats = engine.stats()
    assert stats.cancellations == 1 and stats.finished.get("cancelled") == 1


def test_an_empty_store_restores_on_first_use_and_leaks_nothing(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    engine = engines(exact, **stored(tmp_path / "new"))
    assert len(store_of(engine)) == 0  # empty, so falsy: it must still restore
    history = converse(engine, SYSTEM, USER_TURNS[:1])
    only_on_disk(engine)
    assert store_stats(engine).files >= 1
    turn2 = [*history, *USER_TURNS[1]]
    handle = engine.submit(turn2, GREEDY)
    got = trace(handle)
    assert handle.result().usage.cached_tokens == len(history) - 1
    assert store_stats(engine).hits == 1
    assert got == trace(engines(exact, **CELL).submit(turn2, GREEDY))
    engine.close()
    engine.check_integrity()
    stats = engine.stats()
    assert (stats.slots_in_use, stats.kv_blocks_used) == (0, 0)


def test_what_is_not_a_regular_file_is_refused_and_never_opened(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    directory = tmp_path / "store"
    directory.mkdir()
    os.mkfifo(directory / "fifo.kvsnap")  # opened for reading, it blocked the start
    outside = tmp_path / "outside.kvsnap"
    outside.write_bytes(b"SLOTKV\r\n" + bytes(8))
    (directory / "link.kvsnap").symlink_to(outside)
    (directory / "dangling.kvsnap").symlink_to(tmp_path / "nowhere")
    (directory / "folder.kvsnap").mkdir()
    made: list[ss.Engine] = []
    starting = threading.Thread(
        target=lambda: made.append(engines(exact, **stored(directory))), daemon=True
    )
    starting.start()
    starting.join(30.0)
    assert not starting.is_alive(), "the store's index blocked on a FIFO"
    (engine,) = made
    assert store_stats(engine).refused == {"not_a_file": 4}
    assert store_stats(engine).files == 0
    converse(engine, SYSTEM, USER_TURNS[:1])  # and the store still writes and checks
    store_of(engine).flush()
    store_of(engine).check_integrity()
    assert store_stats(engine).files == 1
    names = {p.name for p in directory.iterdir()}
    assert {"fifo.kvsnap", "link.kvsnap", "dangling.kvsnap", "folder.kvsnap"} <= names
    assert outside.read_bytes() == b"SLOTKV\r\n" + bytes(8)  # left as it was


def test_only_turns_and_prompts_that_were_hit_are_written(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    engine = engines(exact, **stored(tmp_path))
    params = ss.SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    prompts = [[1 + (i * 31 + j * 7) % 250 for j in range(40)] for i in range(6)]
    for prompt in prompts:  # one-shot requests: published in memory, never hit
        engine.submit(prompt, params).result()
    store_of(engine).flush()
    assert store_stats(engine).written == 0
    engine.submit([*prompts[0], 9, 9], params).result()  # a hit: likely to be used again
    store_of(engine).flush()
    # One file for the hit's conversation: the hit prompt's snapshot, offered first, then
    # the turn that extends it. The writer may reach the first before the second comes
    # (two writes, the second covering the first) or not (the second supersedes it in the
    # queue): which one depends on the writer thread's timing, the files left do not.
    hit = store_stats(engine)
    assert hit.written in (1, 2) and hit.written - hit.covered == 1, hit
    before = store_stats(engine).written
    history = converse(engine, SYSTEM, USER_TURNS)  # five turns, each kept for the next
    store_of(engine).flush()
    after = store_stats(engine)
    # Each turn offers its hit prompt's snapshot and then its own turn, which covers it:
    # one write a turn where the writer is slower than the turn, two where it is faster.
    assert 1 <= after.written - before <= 2 * len(USER_TURNS), after
    # Whatever the timing, what stays is one file a conversation (prompts[0]'s and this).
    assert after.written - after.covered - after.evictions == 2, after
    assert after.bytes_written > 0
    only_on_disk(engine)
    turn = [*history, 3, 4]
    assert engine.submit(turn, params).result().usage.cached_tokens == len(history) - 1


def test_short_snapshots_and_writes_past_the_rate_are_skipped_and_counted(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path
) -> None:
    config = stored(tmp_path, prefix_store_min_tokens=30, prefix_store_write_rate=1)
    engine = engines(exact, **config)
    converse(engine, SYSTEM[:10], USER_TURNS[:1])  # 20 tokens: shorter than 30
    store_of(engine).flush()
    assert store_stats(engine).skipped == {"too_short": 1}
    for i in range(3):  # one byte a second: the first write empties the bucket
        converse(engine, [2 + (i * 53 + j) % 200 for j in range(40)], USER_TURNS[:1])
        store_of(engine).flush()
    stats = store_stats(engine)
    assert stats.written == 1 and stats.skipped == {"too_short": 1, "rate_limited": 2}
    with pytest.raises(ValueError, match="prefix_store_write_rate"):
        ss.EngineConfig(**stored(tmp_path, prefix_store_write_rate=0))


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every part of a stored payload takes `PART_S` to read; the names read, in order."""
    read: list[str] = []
    real = store_module.payload_parts

    def slow(handle: Any, entry: StoreEntry) -> Iterator[Any]:
        for spec, part in zip(entry.parts, real(handle, entry), strict=False):
            time.sleep(PART_S)
            read.append(spec[0])
            yield part

    monkeypatch.setattr(store_module, "payload_parts", slow)
    yield read


PART_S = 0.5


def test_a_read_readmitted_from_the_queue_holds_neither_the_lock_nor_a_cancel(
    exact: ss.Model, engines: Callable[..., ss.Engine], tmp_path: Path, slow_disk: list[str]
) -> None:
    engine = engines(exact, **stored(tmp_path, max_seqs=1, queue_depth=2))
    history = converse(engine, SYSTEM, USER_TURNS[:1])
    only_on_disk(engine)
    (entry,) = store_of(engine).entries()
    assert len(entry.parts) >= 4  # the read takes at least 2 s
    blocker = engine.submit([1, 2, 3], LONG)  # the only slot
    queued = engine.submit([*history, *USER_TURNS[1]], GREEDY)  # waits, then re-admitted
    blocker.cancel()
    wait_for(lambda: bool(slow_disk))  # the read began
    # Under the old rule the engine thread read it under its lock, for the whole read.
    assert engine._lock.acquire(timeout=PART_S), "the engine lock is held through a read"
    engine._lock.release()
    ack = queued.cancel(wait=True, timeout=30)
    assert ack is not None
    assert len(slow_disk) < len(entry.parts), "the cancel waited for the whole read"
    engine.close()
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0
