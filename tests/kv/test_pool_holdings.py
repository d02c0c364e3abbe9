"""`KVPool.holdings`: who holds which cells, exactly as the pool's own tables say (cell
blocks with refcounts, shared copy-on-write; flat and ring rows, a ring that wrapped), and a
copy that later changes do not touch."""

from __future__ import annotations

import torch

from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch

INFO = ModelInfo(
    arch="llama", n_layers=2, dim=16, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=32,
    vocab_size=50, max_context=32,
)  # fmt: skip


def commit(pool: KVPool, session: int, n: int) -> None:
    """Commit ``n`` more positions of ``session`` (the bookkeeping of a step)."""
    pool.begin_step(StepBatch([session], [pool.length(session)], [n]))


def test_cell_holdings_are_the_block_tables_with_their_refcounts() -> None:
    config = KVConfig(layout="cell", max_seqs=3, max_context=32, block_size=4, num_blocks=12)
    pool = KVPool(INFO, config)
    pool.reserve(0, 10)  # 3 blocks
    commit(pool, 0, 6)
    pool.publish(0, 6, into=-1)  # shares blocks 0 and 1
    pool.clone(0, 2, into=1)  # shares block 0
    pool.extend(1, 2)
    held = pool.holdings()
    assert held.block_size == 4 and held.row_groups == ()
    assert [h.session for h in held.sessions] == [0, 1]
    assert [h.session for h in held.snapshots] == [-1]
    for holding in (*held.sessions, *held.snapshots):
        bound = {**pool.sessions, **pool.snapshots}[holding.session]
        assert list(holding.blocks) == bound.table
        assert list(holding.refcounts) == [pool.blocks.refcount[b] for b in bound.table]
        assert (holding.length, holding.capacity) == (bound.length, bound.capacity)
        assert holding.rows == ()
    first, clone = held.sessions
    (snapshot,) = held.snapshots
    assert first.refcounts == (3, 2, 1) and clone.refcounts == (3,)
    assert (first.slot, clone.slot, snapshot.slot) == (0, 1, None)
    assert snapshot.blocks == first.blocks[:2]

    commit(pool, 1, 1)  # writes into the shared block: copy-on-write
    pool.release(0)
    assert (first.blocks, first.refcounts, clone.blocks) == ((0, 1, 2), (3, 2, 1), (0,))  # a copy
    later = pool.holdings()
    assert [h.session for h in later.sessions] == [1]
    assert later.sessions[0].blocks == (3,) and later.sessions[0].refcounts == (1,)
    assert later.snapshots[0].refcounts == (1, 1)


def test_flat_and_ring_rows_are_the_cells_the_placement_uses() -> None:
    for layout, size in (("flat", 32), ("ring", 5)):
        pool = KVPool(
            INFO, KVConfig(layout=layout, max_seqs=2, max_context=32, ring_window=4, sinks=1)
        )
        pool.reserve(7, 20)
        pool.reserve(8, 20)
        commit(pool, 7, 3)
        commit(pool, 8, 9)
        held = pool.holdings()
        (group,) = held.row_groups
        assert (group.kind, group.layers, group.size) == (layout, (0, 1), size)
        assert held.block_size is None and held.snapshots == ()
        for holding in held.sessions:
            bound = pool.sessions[holding.session]
            (row,) = holding.rows
            assert holding.slot == bound.slot and holding.blocks == ()
            cells = pool.groups[0].cell_index(bound, torch.arange(bound.length))
            assert set(range(row.first, row.first + row.live)) == set(cells.tolist())
            assert row.group == group
        short, long = held.sessions
        assert (short.rows[0].live, short.rows[0].wrapped) == (3, False)
        assert (long.rows[0].live, long.rows[0].wrapped) == (min(9, size), layout == "ring")
