"""A restore from the prefix store is read without the engine lock, on the engine's restore
thread: `submit` returns at once while the stored conversation is read into its request's
own fresh reservation, and the engine steps the other requests meanwhile (`stats`,
`check_integrity` answer); the read is then committed whole (the cache-off tokens and
log-probabilities, bit for bit, timed inside the prefill span) or, when the file fails its
checksum, not at all (computed instead, equal to cache off). A cancel or a `close` during
the read waits for it, then ends the request and leaves the pool at its baseline.

The read is held open by a gate around the store's payload reader (`store.payload_parts`), so
the tests see the engine between the bind and the commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.prefix import store as store_module
from slotserve.prefix import store_file
from slotserve.testing import write_tiny_gguf
from tests.engine.test_exactness import trace
from tests.engine.test_prefix_store_engine import CELL, GREEDY, USER_TURNS, converse

SYSTEM = [5 + (i * 37) % 200 for i in range(61)]
STREAM = ss.SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    path = write_tiny_gguf(tmp_path_factory.mktemp("read") / "tiny-q8.gguf", "llama", "Q8_0")
    return ss.load(path, progress=False)


class Gate:
    """Holds the store's payload reads until `open` (``entered``: a read is waiting)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        real = store_file.payload_parts

        def gated(handle: Any, entry: store_module.StoreEntry) -> Iterator[Any]:
            self.entered.set()
            assert self.opened.wait(30), "the gate was never opened"
            yield from real(handle, entry)

        monkeypatch.setattr(store_module, "payload_parts", gated)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def stored(exact: ss.Model, tmp_path: Path) -> tuple[dict[str, Any], list[int]]:
    """A store holding a 4-turn conversation; its config and the next turn's prompt."""
    config = {**CELL, "prefix_cache_bytes": "4MiB", "prefix_store": tmp_path}
    with ss.Engine(exact, ss.EngineConfig(**config)) as first:
        history = converse(first, SYSTEM, USER_TURNS[:4])
    return config, [*history, *USER_TURNS[4]]


def cold_trace(model: ss.Model, prompt: list[int]) -> list[Any]:
    with ss.Engine(model, ss.EngineConfig(**CELL)) as engine:
        return trace(engine.submit(prompt, GREEDY))


def test_the_engine_steps_others_while_a_stored_prefix_is_read(
    exact: ss.Model, stored: tuple[dict[str, Any], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, turn5 = stored
    cold = cold_trace(exact, turn5)
    engine = ss.Engine(exact, ss.EngineConfig(**config))
    try:
        stream = engine.submit([3, 1, 4, 1, 5], STREAM)
        events = iter(stream)
        next(events)  # it is running
        gate = Gate(monkeypatch)
        handle = engine.submit(turn5, GREEDY)  # returns with the read still held open
        assert gate.entered.wait(30)
        # The other request keeps getting steps meanwhile.
        tokens = [e for _, e in zip(range(10), events, strict=False)]
        assert len(tokens) == 10 and all(isinstance(e, ss.TokenEvent) for e in tokens)
        stats = engine.stats()  # the lock is free
        assert stats.slots_in_use == 2 and stats.sessions_by_state.get("prefill") == 1
        engine.check_integrity()
        gate.open()
        got = trace(handle)
        final = handle.result()
        assert final.usage.cached_tokens == len(turn5) - len(USER_TURNS[4]) - 1
        timings = final.timings
        assert timings.restore_started is not None and timings.first_scheduled is not None
        # The read (held open a while) is inside the prefill span, before the first step.
        assert timings.restore_started + timings.restore_time <= timings.first_scheduled
        assert timings.restore_started <= timings.admitted  # type: ignore[operator]
        assert got == cold  # tokens, logprobs, top 5: bit for bit
        assert stream.result().reason == "length"
        prefix = engine.stats().prefix
        assert prefix is not None and prefix.store is not None and prefix.store.hits == 1
    finally:
        engine.close()
    engine.check_integrity()


def test_a_file_that_fails_while_read_unlocked_commits_nothing(
    exact: ss.Model, stored: tuple[dict[str, Any], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, turn5 = stored
    cold = cold_trace(exact, turn5)
    engine = ss.Engine(exact, ss.EngineConfig(**config))  # indexed while the files were whole
    try:
        for path in Path(config["prefix_store"]).glob("*.kvsnap"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x40  # a payload byte, after the index read the headers
            path.write_bytes(bytes(data))
        gate = Gate(monkeypatch)
        handle = engine.submit(turn5, GREEDY)
        assert gate.entered.wait(30)
        gate.open()
        assert trace(handle) == cold
        assert handle.result().usage.cached_tokens == 0
        prefix = engine.stats().prefix
        assert prefix is not None and prefix.store is not None
        assert prefix.store.refused == {"checksum": 1} and prefix.store.hits == 0
        assert prefix.misses >= 1 and prefix.hits == 0
        engine.check_integrity()
    finally:
        engine.close()
    engine.check_integrity()


def test_close_during_the_read_waits_for_it_then_ends_the_request(
    exact: ss.Model, stored: tuple[dict[str, Any], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, turn5 = stored
    engine = ss.Engine(exact, ss.EngineConfig(**config))
    baseline = engine.pool.usage()
    gate = Gate(monkeypatch)
    handle = engine.submit(turn5, GREEDY)
    assert gate.entered.wait(30)
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # the engine does not stop under a read into its pool
    gate.open()
    closing.join(30)
    assert not closing.is_alive()
    assert handle.result().reason == "cancelled"
    engine.check_integrity()
    usage = engine.pool.usage()
    assert (usage.free, usage.used) == (baseline.free, baseline.used)


def test_a_cancel_during_the_read_is_released_once_it_ends(
    exact: ss.Model, stored: tuple[dict[str, Any], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, turn5 = stored
    engine = ss.Engine(exact, ss.EngineConfig(**config))
    try:
        baseline = engine.pool.usage()
        gate = Gate(monkeypatch)
        handle = engine.submit(turn5, GREEDY)
        assert gate.entered.wait(30)
        assert handle.cancel() is None  # returns at once
        acks: list[ss.CancelAck | None] = []
        waiting = threading.Thread(target=lambda: acks.append(handle.cancel(wait=True)))
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()  # its cells are being written: not released yet
        gate.open()
        waiting.join(30)
        assert acks and acks[0] is not None and acks[0].latency_s > 0
        assert handle.result().reason == "cancelled"
        engine.check_integrity()
        assert engine.stats().slots_in_use == 0
        assert not engine.pool.session_ids()  # its slot and KV went back
        assert engine.pool.usage() == baseline
    finally:
        engine.close()
    engine.check_integrity()


def test_a_cancel_stops_a_slow_read_before_its_next_part(
    exact: ss.Model, stored: tuple[dict[str, Any], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow store (each part's read sleeps): a cancel during the read is released after
    at most the part being read, not after the whole file, and the pool is at its baseline."""
    config, turn5 = stored
    real = store_file.payload_parts
    read: list[int] = []  # parts handed to the pool
    first = threading.Event()
    total: list[int] = []

    def slow(handle: Any, entry: store_module.StoreEntry) -> Iterator[Any]:
        parts = list(real(handle, entry))
        total.append(len(parts))
        for part in parts:
            time.sleep(0.2)
            read.append(1)
            first.set()
            yield part

    monkeypatch.setattr(store_module, "payload_parts", slow)
    engine = ss.Engine(exact, ss.EngineConfig(**config))
    try:
        baseline = engine.pool.usage()
        handle = engine.submit(turn5, GREEDY)
        assert first.wait(30)
        at_cancel = len(read)
        ack = handle.cancel(wait=True)
        assert ack is not None
        assert handle.result().reason == "cancelled"
        assert total and total[0] > at_cancel + 1  # the file had parts left to read
        assert len(read) <= at_cancel + 1  # at most the part in flight was read after
        engine.check_integrity()
        assert engine.stats().slots_in_use == 0
        assert engine.pool.usage() == baseline
        prefix = engine.stats().prefix
        assert prefix is not None and prefix.store is not None and prefix.store.hits == 0
    finally:
        engine.close()
    engine.check_integrity()
