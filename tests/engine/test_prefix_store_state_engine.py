"""The engine with the prefix cache's disk tier under random requests, cancels, handles
dropped without cancel (their finalizers run by a collection on a thread that holds the
store's lock, as the writer does) and snapshots evicted from memory, so restores come from
disk, with the store starting empty and starting full (hypothesis state machine), the
garbage collector forced often: engine, pool, cache and store invariants hold after every
step, no thread inverts the lock order (the suite's check), and `close` returns within its
bound with no slot, block or snapshot left."""

from __future__ import annotations

import gc
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import slotserve as ss
from slotserve.prefix import PrefixStore
from slotserve.testing import write_tiny_gguf
from tests.engine.test_prefix_state import PrefixEngineMachine

SYSTEMS = [[3 + (i * 7 + n) % 200 for i in range(n)] for n in (6, 19, 30)]
PROMPT = st.tuples(
    st.integers(0, len(SYSTEMS) - 1), st.lists(st.integers(40, 60), min_size=0, max_size=6)
)
CLOSE_BOUND_S = 30.0
Dropped = None  # a handle's place once it was dropped


def config(directory: Path) -> ss.EngineConfig:
    return ss.EngineConfig(
        kv_layout="cell", block_size=4, num_blocks=40, max_seqs=3, max_context=64,
        queue_depth=4, prefill_chunk=8, prefix_cache_bytes=12 * 4 * 2 * 2 * 2 * 32 * 4,
        prefix_store=directory, prefix_store_bytes=400_000, prefix_store_min_tokens=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    path = write_tiny_gguf(tmp_path_factory.mktemp("store-state") / "tiny.gguf", "llama", "Q8_0")
    return ss.load(path, progress=False)


@pytest.fixture(scope="module")
def full_store(model: ss.Model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store directory that conversations on every system prompt filled."""
    directory = tmp_path_factory.mktemp("full-store")
    engine = ss.Engine(model, config(directory))
    params = ss.SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    for system in SYSTEMS:
        for tail in ([40, 41], [40, 41, 50, 51, 52]):
            engine.submit([*system, *tail], params, publish_completion=True).result()
    engine.close()
    assert list(directory.glob("*.kvsnap"))
    return directory


@pytest.fixture
def frequent_gc() -> Iterator[None]:
    """Collections every few allocations, so finalizers run on whatever thread allocates."""
    before = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    yield
    gc.set_threshold(*before)


class StoreEngineMachine(PrefixEngineMachine):
    """`PrefixEngineMachine`'s rules and checks, over an engine with a store, and more."""

    seed_store: Path | None
    root: Path

    def config(self) -> ss.EngineConfig:
        directory = Path(tempfile.mkdtemp(dir=self.root))
        if self.seed_store is not None:
            shutil.copytree(self.seed_store, directory, dirs_exist_ok=True)
        return config(directory)

    @property
    def store(self) -> PrefixStore:
        prefix = self.engine.prefix
        assert prefix is not None and prefix.store is not None
        return prefix.store

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 100))
    def drop_under_the_store_lock(self, index: int) -> None:
        """Forget a handle without cancel; its finalizer runs on a thread holding the
        store's lock (as a collection on the writer runs it), which must not wait."""
        i = index % len(self.handles)
        holder = [self.handles[i][0]]
        self.handles[i] = (Dropped, self.handles[i][1])
        done = threading.Event()

        def drop() -> None:
            with self.store._lock:
                holder.clear()
                gc.collect()
                done.set()

        threading.Thread(target=drop, daemon=True).start()
        assert done.wait(10.0), "a finalizer waited under the store's lock"

    @rule()
    def only_on_disk(self) -> None:
        """Write what is queued, then drop every snapshot from memory (restores from disk)."""
        self.store.flush()
        prefix = self.engine.prefix
        assert prefix is not None
        with self.engine._lock:
            while prefix.evict_one():
                pass

    def teardown(self) -> None:
        began = time.monotonic()
        self.engine.close(timeout=CLOSE_BOUND_S)
        assert time.monotonic() - began < CLOSE_BOUND_S, "close ran past its bound"
        self.engine.check_integrity()
        self.store.check_integrity()
        stats = self.engine.stats()
        assert stats.prefix is not None
        assert (stats.kv_blocks_used, stats.prefix.snapshots, stats.slots_in_use) == (0, 0, 0)
        assert stats.finished.get("error", 0) == 0


@pytest.mark.parametrize("start", ["empty", "full"])
def test_prefix_store_engine_state_machine(
    model: ss.Model, full_store: Path, start: str, tmp_path: Path, frequent_gc: None
) -> None:
    StoreEngineMachine.model, StoreEngineMachine.root = model, tmp_path
    StoreEngineMachine.seed_store = full_store if start == "full" else None
    machine = StoreEngineMachine.TestCase
    machine.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
    machine().runTest()
