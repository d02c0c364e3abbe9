"""KVPool snapshots: slotless, read-only block holders that copy-on-write keeps intact."""

from __future__ import annotations

import pytest
import torch

from slotserve.errors import KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels

INFO = ModelInfo(
    arch="llama", n_layers=2, dim=16, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=32,
    vocab_size=50, max_context=32,
)  # fmt: skip


def cell_pool(num_blocks: int = 12, max_seqs: int = 2) -> KVPool:
    config = KVConfig(
        layout="cell", max_seqs=max_seqs, max_context=32, block_size=4, num_blocks=num_blocks
    )
    return KVPool(INFO, config, attention=build_kernels().attention)


def write(pool: KVPool, session: int, n: int, value: float) -> None:
    """Commit ``n`` positions of ``session`` whose keys are all ``value`` (layer 0)."""
    start = pool.length(session)
    batch = StepBatch([session], [start], [n])
    pool.begin_step(batch)
    k = torch.full((n, INFO.n_kv_heads, INFO.head_dim), value)
    q = torch.zeros(n, INFO.n_heads, INFO.head_dim)
    pool.update_and_attend(0, torch.cat([q.flatten(1), k.flatten(1), k.flatten(1)], 1), batch)


def keys(pool: KVPool, session: int, n: int, snapshots: bool = False) -> torch.Tensor:
    table = (pool.snapshots if snapshots else pool.sessions)[session]
    group = pool.groups[0]
    cells = group.cell_index(table, torch.arange(n))
    return group.keys[0].gather(cells.view(1, -1))[0, :, 0, 0]


def test_a_snapshot_takes_no_slot_and_survives_writes_of_its_source() -> None:
    pool = cell_pool(max_seqs=1)
    pool.reserve(0, 16)
    write(pool, 0, 6, 1.0)
    pool.publish(0, 6, into=-1)
    assert pool.free_slots == 0 and pool.snapshot_ids() == {-1}
    write(pool, 0, 2, 2.0)  # into the shared second block: copy-on-write
    pool.check_integrity()
    assert keys(pool, -1, 6, snapshots=True).tolist() == [1.0] * 6
    pool.release(0)
    pool.reserve_from(0, 12, -1, 5)  # the only slot, restored from the snapshot
    assert pool.length(0) == 5
    write(pool, 0, 3, 3.0)
    assert keys(pool, 0, 8).tolist() == [1.0] * 5 + [3.0] * 3
    assert keys(pool, -1, 6, snapshots=True).tolist() == [1.0] * 6
    pool.check_integrity()
    pool.release(0)
    pool.drop_snapshot(-1)
    pool.check_integrity()
    assert pool.blocks.n_free == pool.blocks.total and pool.free_slots == 1


def test_no_step_can_write_into_a_snapshot() -> None:
    pool = cell_pool()
    pool.reserve(0, 8)
    write(pool, 0, 4, 1.0)
    pool.publish(0, 4, into=-1)
    with pytest.raises(SessionError):
        pool.begin_step(StepBatch([-1], [4], [1]))


def test_reserve_from_is_all_or_nothing() -> None:
    pool = cell_pool(num_blocks=4)
    pool.reserve(0, 8)
    write(pool, 0, 6, 1.0)
    pool.publish(0, 6, into=-1)
    pool.release(0)
    before = (sorted(pool.blocks.free), list(pool.blocks.refcount), pool.free_slots)
    with pytest.raises(KVExhausted):
        pool.reserve_from(1, 32, -1, 6)  # 8 blocks: 2 shared + 6 fresh > 2 free
    assert before == (sorted(pool.blocks.free), list(pool.blocks.refcount), pool.free_slots)
    with pytest.raises(SessionError):
        pool.reserve_from(1, 8, -1, 7)  # past the snapshot
    with pytest.raises(SessionError):
        pool.reserve_from(1, 8, -5, 2)  # unknown snapshot
    pool.check_integrity()


def test_copy_on_write_room_counts_snapshot_holders() -> None:
    """A request restored mid-block will copy that block: the room is held back."""
    pool = cell_pool(num_blocks=3)
    pool.reserve(0, 4)
    write(pool, 0, 3, 1.0)
    pool.publish(0, 3, into=-1)
    pool.release(0)
    pool.reserve_from(1, 8, -1, 3)  # 1 shared block (to be copied) + 1 fresh
    assert pool._cow_needed(pool.sessions) == 1
    with pytest.raises(KVExhausted):
        pool.reserve(2, 4)  # the last free block is the pending copy's
    write(pool, 1, 2, 2.0)
    pool.check_integrity()


def test_a_flat_pool_never_copies_a_running_sessions_rows_out() -> None:
    """A flat pool's snapshots are parked slots only: publishing a running session (which
    could only copy its rows out of the pool) is refused, changing nothing."""
    config = KVConfig(layout="flat", max_seqs=2, max_context=32)
    flat = KVPool(INFO, config, attention=build_kernels().attention)
    flat.reserve(0, 8)
    write(flat, 0, 3, 1.0)
    with pytest.raises(SessionError, match="parked slots"):
        flat.publish(0, 3, into=-1)
    assert flat.snapshot_ids() == set() and flat.length(0) == 3
    assert flat.snapshot_copy_nbytes == 0
    flat.check_integrity()


def test_a_flat_pool_parks_a_finished_slot_and_hands_it_over_in_place() -> None:
    """`release_into` in a flat pool keeps the slot as the snapshot (nothing copied out of
    the pool); consuming it gives the same slot, rows in place, to the next session; a
    restore that does not consume copies the rows into a free slot; dropping frees it."""
    config = KVConfig(layout="flat", max_seqs=2, max_context=32)
    flat = KVPool(INFO, config, attention=build_kernels().attention)
    assert flat.parks_slots
    flat.reserve(0, 8)
    write(flat, 0, 4, 1.0)
    slot = flat.slot_of(0)
    flat.release_into(0, 3, into=-1)
    flat.check_integrity()
    assert (flat.free_slots, flat.parked_slots, flat.snapshot_copied_nbytes(-1)) == (1, 1, 0)
    assert flat.usage().used == 1 and flat.holdings().snapshots[0].slot == slot
    assert torch.equal(keys(flat, -1, 3, snapshots=True), torch.ones(3))
    payload = list(flat.read_payload(flat.payload_of(-1)))  # views of the parked rows
    assert all(part.shape[0] == 3 for part in payload) and len(payload) == 4

    flat.reserve_from(1, 10, snapshot=-1, upto=2)  # a free slot: the rows are copied
    assert flat.slot_of(1) != slot and flat.parked_slots == 1
    write(flat, 1, 1, 7.0)
    assert torch.equal(keys(flat, 1, 3), torch.tensor([1.0, 1.0, 7.0]))
    flat.check_integrity()
    with pytest.raises(KVExhausted, match="session slots"):  # the other slot is parked
        flat.reserve(2, 4)

    flat.reserve_from(2, 12, snapshot=-1, upto=3, consume=True)  # the parked slot itself
    assert flat.slot_of(2) == slot and flat.snapshot_ids() == set() and flat.free_slots == 0
    assert torch.equal(keys(flat, 2, 3), torch.ones(3))
    flat.check_integrity()
    flat.release_into(2, 3, into=-2)
    flat.drop_snapshot(-2)
    flat.release(1)
    assert (flat.free_slots, flat.parked_slots) == (2, 0)
    flat.check_integrity()
