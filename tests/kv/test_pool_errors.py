"""KVPool: copy-on-write, and bad input that must fail cleanly with a typed error."""

from __future__ import annotations

import pytest
import torch

from slotserve.errors import ContextOverflow, KVExhausted, SessionError
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels
from tests.kv.test_pool_state import INFO


def cell_pool(num_blocks: int = 8) -> KVPool:
    return KVPool(
        INFO,
        KVConfig(layout="cell", max_seqs=3, max_context=32, block_size=4, num_blocks=num_blocks),
        attention=build_kernels().attention,
    )


def write(pool: KVPool, session: int, values: list[float]) -> None:
    start = pool.length(session)
    batch = StepBatch.single(start, len(values), session)
    pool.begin_step(batch)
    keys = torch.tensor(values).view(-1, 1, 1).expand(-1, 1, 4).contiguous()
    q = torch.zeros(len(values), 2, 4)
    qkv = torch.cat([q.flatten(1), keys.flatten(1), keys.flatten(1)], 1)
    for layer in range(INFO.n_layers):
        pool.update_and_attend(layer, qkv, batch)


def stored(pool: KVPool, session: int) -> list[float]:
    group = pool.groups[0]
    bound = pool.sessions[session]
    cells = group.cell_index(bound, torch.arange(bound.length))
    return group.keys[0].gather(cells)[:, 0, 0].tolist()


def test_copy_on_write_isolates_a_clone() -> None:
    pool = cell_pool()
    pool.reserve(0, 8)
    write(pool, 0, [1, 2, 3, 4, 5, 6])
    used = pool.blocks.n_used
    clone = pool.clone(0, 6)
    assert pool.blocks.n_used == used  # shared, not copied
    pool.extend(clone, 2)
    write(pool, clone, [70, 80])  # writes into the shared second block: it is copied first
    write(pool, 0, [7, 8])
    assert stored(pool, 0) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert stored(pool, clone) == [1, 2, 3, 4, 5, 6, 70, 80]
    assert pool.sessions[0].table[0] == pool.sessions[clone].table[0]  # first block still shared
    pool.check_integrity()


def test_rewind_then_write_copies_shared_block() -> None:
    pool = cell_pool()
    pool.reserve(0, 8)
    write(pool, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    clone = pool.clone(0, 8)
    pool.rewind(0, 3)
    write(pool, 0, [60, 70, 80])
    assert stored(pool, clone) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert stored(pool, 0) == [1, 2, 3, 4, 5, 60, 70, 80]
    pool.check_integrity()


def test_blocks_for_pending_copies_are_held_back() -> None:
    pool = cell_pool(num_blocks=4)
    pool.reserve(0, 6)  # 2 blocks
    write(pool, 0, [1, 2, 3, 4, 5, 6])
    pool.clone(0, 6, into=1)  # shares both; block 1 is partial: one copy may be needed
    with pytest.raises(KVExhausted):
        pool.reserve(2, 8)  # 2 free, but one is held back for copy-on-write
    pool.reserve(2, 4)
    pool.check_integrity()


def snapshot(pool: KVPool) -> object:
    return (
        sorted(pool.blocks.free),
        list(pool.blocks.refcount),
        {s: (b.slot, b.capacity, b.length, list(b.table)) for s, b in pool.sessions.items()},
    )


def test_bad_operations_change_nothing() -> None:
    pool = cell_pool(num_blocks=4)
    pool.reserve(0, 8)
    write(pool, 0, [1, 2, 3])
    before = snapshot(pool)
    with pytest.raises(KVExhausted, match="needs 3 KV blocks but 2 are free"):
        pool.reserve(1, 12)
    with pytest.raises(ContextOverflow):
        pool.reserve(1, 33)
    with pytest.raises(SessionError, match="past session 0's committed length 3"):
        pool.clone(0, 4)
    with pytest.raises(SessionError, match="unknown session 9"):
        pool.release(9)
    with pytest.raises(SessionError, match="already holds"):
        pool.reserve(0, 1)
    with pytest.raises(ContextOverflow):
        pool.begin_step(StepBatch.single(3, 6, 0))
    with pytest.raises(SessionError, match="must append at 3"):
        pool.begin_step(StepBatch.single(2, 1, 0))
    assert snapshot(pool) == before
    pool.release(0)
    with pytest.raises(SessionError):
        pool.release(0)
    assert pool.blocks.n_free == 4 and pool.free_slots == 3


def test_slots_run_out_cleanly() -> None:
    pool = KVPool(INFO, KVConfig(layout="flat", max_seqs=2, max_context=32))
    pool.reserve(0, 4)
    pool.reserve(1, 4)
    with pytest.raises(KVExhausted, match="session slots"):
        pool.reserve(2, 4)
    pool.release(0)
    pool.reserve(2, 4)
    pool.check_integrity()


def test_block_size_must_divide_context() -> None:
    with pytest.raises(ValueError, match="block_size=12 does not divide max_context=32"):
        KVConfig(layout="cell", max_context=32, block_size=12)


def test_ring_refuses_rewind_past_the_window() -> None:
    pool = KVPool(INFO, KVConfig(layout="ring", max_seqs=1, max_context=32, ring_window=4))
    pool.reserve(0, 32)
    write(pool, 0, [float(i) for i in range(10)])
    pool.rewind(0, 1)  # the window still holds what position 9 needs
    with pytest.raises(SessionError, match="left the ring"):
        pool.rewind(0, 3)
    assert pool.length(0) == 9
