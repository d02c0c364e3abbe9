"""PrefixCache over a real cell pool (no model): longest usable match, final-token replay,
LRU eviction by bytes, pins, eviction under KV pressure, and clear."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slotserve.errors import KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels
from slotserve.prefix import PrefixCache

INFO = ModelInfo(
    arch="llama", n_layers=2, dim=16, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=32,
    vocab_size=50, max_context=32,
)  # fmt: skip
BS = 4


def make(num_blocks: int = 24, budget_blocks: int = 8, max_seqs: int = 4) -> PrefixCache:
    config = KVConfig(
        layout="cell", max_seqs=max_seqs, max_context=32, block_size=BS, num_blocks=num_blocks
    )
    pool = KVPool(INFO, config, attention=build_kernels().attention)
    return PrefixCache(pool, budget_blocks * pool.block_nbytes)


def prefill(cache: PrefixCache, session: int, tokens: list[int], extra: int = 4) -> int:
    """Bind ``session`` through the cache, 'compute' the rest of ``tokens``, publish."""
    restored = cache.bind(session, tokens, len(tokens) + extra)
    pool = cache.pool
    n = len(tokens) - restored
    batch = StepBatch([session], [restored], [n])
    pool.begin_step(batch)
    qkv = torch.zeros(n, (INFO.n_heads + 2 * INFO.n_kv_heads) * INFO.head_dim)  # [q | k | v]
    pool.update_and_attend(0, qkv, batch)
    cache.publish(session, tokens)
    cache.check_integrity()
    pool.check_integrity()
    return restored


def test_longest_usable_match_and_final_token_replay() -> None:
    cache = make()
    system = [1, 2, 3, 4, 5, 6]
    assert prefill(cache, 0, [*system, 7]) == 0
    assert prefill(cache, 1, [*system, 8, 9]) == 6  # shares the system prompt only
    assert prefill(cache, 2, [*system, 7]) == 6  # whole prompt matched: last one replayed
    assert prefill(cache, 3, [9, 9]) == 0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.tokens_restored) == (2, 2, 12)
    assert len(cache) == 3  # the repeated prompt was already covered: not published again


def test_lru_eviction_by_bytes_keeps_the_budget() -> None:
    cache = make(budget_blocks=4)
    for session, first in enumerate((10, 20, 30)):
        prefill(cache, session, [first, 1, 2, 3, 4, 5])  # 2 blocks each
        cache.pool.release(session)
    assert len(cache) == 2 and cache.stats.evictions == 1
    assert cache.bytes_pinned <= cache.budget_bytes
    assert prefill(cache, 5, [10, 1, 2]) == 0  # the oldest was the one evicted
    cache.pool.release(5)
    assert prefill(cache, 6, [30, 1, 2]) == 2


def test_a_snapshot_over_the_budget_is_not_published() -> None:
    cache = make(budget_blocks=1)
    prefill(cache, 0, list(range(1, 10)))  # 3 blocks > 1
    assert len(cache) == 0 and cache.pool.snapshot_ids() == set()


def test_bind_evicts_before_kv_is_exhausted_but_never_its_own_source() -> None:
    cache = make(num_blocks=8, budget_blocks=8, max_seqs=3)
    prefill(cache, 0, [1, 2, 3, 4, 5, 6, 7, 8], extra=0)  # 2 blocks
    prefill(cache, 1, [9, 9, 9, 9, 9, 9, 9, 9], extra=0)  # 2 more
    cache.pool.release(0)
    cache.pool.release(1)
    assert cache.pool.blocks.n_free == 4
    # Restores 7 from [1..8] (2 shared blocks) and needs 4 fresh: evicts [9...] only.
    assert cache.bind(2, [1, 2, 3, 4, 5, 6, 7, 8], 24) == 7
    assert cache.stats.evictions == 1 and len(cache) == 1
    assert cache.pins == 0
    cache.check_integrity()
    with pytest.raises(KVExhausted):  # even an empty cache could not make room
        cache.bind(3, [4, 4], 32)
    cache.pool.check_integrity()
    cache.check_integrity()


def test_clear_returns_the_pool_to_baseline() -> None:
    cache = make()
    prefill(cache, 0, [1, 2, 3, 4, 5])
    prefill(cache, 1, [1, 2, 3, 4, 6])
    for session in (0, 1):
        cache.pool.release(session)
    cache.clear()
    cache.check_integrity()
    assert cache.pool.blocks.n_free == cache.pool.blocks.total and cache.bytes_pinned == 0


def test_a_budget_is_required() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(make().pool, 0)


def test_release_into_keeps_a_finished_conversation_and_replaces_what_it_extends() -> None:
    cache = make(num_blocks=16, budget_blocks=16)
    pool = cache.pool
    prefill(cache, 0, [1, 2, 3, 4, 5])  # publishes the prompt
    pool.begin_step(StepBatch([0], [5], [3]))  # three decode positions, as the engine would
    assert cache.release_into(0, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(cache) == 1 and 0 not in pool.session_ids()  # the prompt's snapshot replaced
    cache.check_integrity()
    pool.check_integrity()
    assert cache.bind(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], 12) == 8
    pool.release(1)
    prefill(cache, 2, [7, 7])
    assert not cache.release_into(2, [7, 7])  # covered already: a plain release
    assert 2 not in pool.session_ids() and len(cache) == 2
    cache.check_integrity()
    pool.check_integrity()


def test_a_full_pool_restores_by_consuming_the_matched_snapshot() -> None:
    # One slot, blocks for one max_context session: the conversation's snapshot holds
    # blocks the next turn's whole-context reservation needs.
    cache = make(num_blocks=8, budget_blocks=8, max_seqs=1)
    pool = cache.pool
    prefill(cache, 0, [1, 2, 3, 4, 5, 6], extra=2)
    pool.begin_step(StepBatch([0], [6], [1]))
    cache.release_into(0, [1, 2, 3, 4, 5, 6, 9])  # 7 positions: its last block half full
    assert cache.bind(1, [1, 2, 3, 4, 5, 6, 9, 10], 32) == 7  # all 8 blocks reserved
    assert len(cache) == 0 and cache.stats.evictions == 1  # consumed, counted
    cache.check_integrity()
    pool.check_integrity()
    pool.begin_step(StepBatch([1], [7], [25]))  # writes into the once-shared block: no copy
    pool.release(1)
    pool.check_integrity()
    assert pool.usage().used == 0


def test_a_sliding_window_ring_serves_only_what_it_still_holds() -> None:
    info = dataclasses.replace(INFO, sliding_window=(None, 4))  # layer 1: a ring of 4
    pool = KVPool(info, KVConfig(layout="cell", max_seqs=2, max_context=32, block_size=BS))
    assert pool.supports_snapshots and pool.snapshot_ring_nbytes > 0
    pool.reserve(0, 16)
    pool.begin_step(StepBatch([0], [0], [10]))  # the ring now holds positions 6..9
    pool.publish(0, 10, -1)
    assert pool.retains(-1, 10) and pool.retains(-1, 9) and not pool.retains(-1, 8)
    with pytest.raises(SessionError, match="wrapped"):
        pool.reserve_from(1, 16, -1, 6)
    pool.check_integrity()
    pool.reserve_from(1, 16, -1, 9)
    assert pool.sessions[1].high_water == 10  # its ring row is the snapshot's
    pool.release(1)
    pool.drop_snapshot(-1)
    pool.release(0)
    pool.check_integrity()
    assert pool.usage().used == 0
