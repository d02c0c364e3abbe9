"""The step's `StepPlan`: made once by `begin_step` after copy-on-write, read by every
layer, and refused for a step this pool did not begin."""

from __future__ import annotations

import pytest
import torch

from slotserve.errors import SessionError
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.kv.plan import PrefixPlan, StepPlan
from slotserve.native import build_kernels
from tests.kv.test_pool_errors import cell_pool, write
from tests.kv.test_pool_state import INFO


def rows(n: int, heads: int = INFO.n_heads) -> torch.Tensor:
    """Fused ``[q | k | v]`` rows of ``heads`` query heads for ``n`` tokens."""
    return torch.randn(n, (heads + 2 * INFO.n_kv_heads) * INFO.head_dim)


def storage_bytes(pool: KVPool) -> list[torch.Tensor]:
    return [s.data.clone() for g in pool.groups for s in (*g.keys.values(), *g.values.values())]


@pytest.mark.parametrize("kernel", [True, False])
def test_a_step_not_begun_in_the_pool_is_refused_having_written_nothing(kernel: bool) -> None:
    attention = build_kernels().attention if kernel else None
    config = KVConfig(layout="flat", max_seqs=2, max_context=16)
    pool, other = (KVPool(INFO, config, attention) for _ in range(2))
    for p in (pool, other):
        p.reserve(0, 8)
    never_begun = StepBatch.single(0, 3)
    begun_elsewhere = StepBatch.single(0, 3)
    other.begin_step(begun_elsewhere)
    before = storage_bytes(pool)
    for batch in (never_begun, begun_elsewhere):
        with pytest.raises(SessionError, match="begin_step"):
            pool.update_and_attend(0, rows(3), batch)
        scratch = torch.empty(3, INFO.n_heads * INFO.head_dim)
        if kernel:
            with pytest.raises(SessionError, match="begin_step"):
                pool.attention_calls(batch, rows(3), INFO.n_heads, scratch)
    after = storage_bytes(pool)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert pool.length(0) == 0
    pool.check_integrity()


def test_the_plan_writes_the_blocks_copy_on_write_gave_the_session() -> None:
    """Planned after the un-sharing: the cells a step writes are in blocks only the
    stepping session holds, and every layer reads that one plan."""
    pool = cell_pool()
    pool.reserve(0, 10)
    write(pool, 0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # blocks of 4: the second is half full
    pool.clone(0, 6, into=1)  # shares both blocks
    pool.extend(1, 4)
    batch = StepBatch.single(6, 3, session=1)
    pool.begin_step(batch)
    plan = batch.plan
    assert isinstance(plan, StepPlan) and plan.owner is pool
    (group_plan,) = plan.groups
    assert isinstance(group_plan, PrefixPlan) and group_plan.kernel is not None
    bs = pool.config.block_size
    written = {int(cell) // bs for cell in group_plan.write}
    assert written and all(pool.blocks.refcount[block] == 1 for block in written)
    assert written <= set(pool.sessions[1].table) and not written & set(pool.sessions[0].table)
    for layer in range(INFO.n_layers):
        pool.update_and_attend(layer, rows(3), batch)
        assert batch.plan is plan
    pool.check_integrity()


def test_rows_of_another_head_count_than_planned_are_refused() -> None:
    """The kernel's scratch is sized by the plan's head count: other rows never reach it."""
    for layout in ("cell", "ring"):
        config = KVConfig(layout=layout, max_seqs=1, max_context=16, ring_window=8)
        pool = KVPool(INFO, config, build_kernels().attention)
        pool.reserve(0, 8)
        batch = StepBatch.single(0, 2)
        pool.begin_step(batch)
        with pytest.raises(ValueError, match="planned for 2"):
            pool.update_and_attend(0, rows(2, heads=4), batch)
