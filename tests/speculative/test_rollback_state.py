"""KV rollback after speculative steps, under random operations (hypothesis state machines
built on the pool's own, tests/kv/test_pool_state.py): a speculative write appends a draft,
then keeps a random number of its rows (`KVPool.hold_tentative` before the step,
`KVPool.roll_back` after). After every step the pool's invariants hold and every position a
session's next query can see holds exactly what plain decoding (only the kept rows ever
written) would have left there, on flat, cell, ring, and cell beside a sliding-window ring;
a rejected ring row never leaves its window's older rows overwritten."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from slotserve.errors import SessionError
from slotserve.kv import KVConfig, KVPool, StepBatch
from tests.kv.test_pool_state import INFO, PoolMachine


class SpeculativePoolMachine(PoolMachine):
    """The pool machine, with speculative writes beside its plain ones."""

    @precondition(lambda self: self.written)
    @rule(data=st.data(), drafted=st.integers(1, 9))
    def speculative_write(self, data: st.DataObject, drafted: int) -> None:
        session = data.draw(st.sampled_from(sorted(self.written)))
        bound = self.pool.sessions[session]
        start = bound.length
        end = min(start + 1 + drafted, bound.capacity, start + self.pool.tentative_span)
        if end <= start + 1:
            return  # no room for a draft: the engine drafts only within the reservation
        high_water = bound.high_water
        held = self.pool.hold_tentative(session, start + 1, end)
        batch = StepBatch.single(start, end - start, session)
        self.pool.begin_step(batch)
        self.counter += 1
        n = end - start
        keys = torch.full((n, 1, 4), float(self.counter)) + torch.arange(n).view(-1, 1, 1) / 100
        qkv = torch.cat([torch.zeros(n, 8), keys.flatten(1), keys.flatten(1)], 1)
        for layer in range(self.info.n_layers):
            self.pool.update_and_attend(layer, qkv, batch)
        keep = data.draw(st.integers(start + 1, end))
        self.pool.roll_back(held, keep)
        assert bound.length == keep
        assert bound.high_water == max(high_water, keep)
        stored = keys[: keep - start].to(self.config.torch_dtype).float()
        self.written[session] = torch.cat([self.written[session], stored])

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def roll_back_refuses_what_it_did_not_hold(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.written)))
        bound = self.pool.sessions[session]
        end = min(bound.capacity, bound.length + self.pool.tentative_span)
        if bound.length >= end:
            return
        held = self.pool.hold_tentative(session, bound.length, end)
        before = (bound.length, bound.high_water)
        with pytest.raises(SessionError):  # the step never ran: nothing to roll back
            self.pool.roll_back(held, bound.length)
        assert (bound.length, bound.high_water) == before


class FlatSpeculativeMachine(SpeculativePoolMachine):
    config = KVConfig(layout="flat", max_seqs=3, max_context=32)


class RingSpeculativeMachine(SpeculativePoolMachine):
    # Every layer a ring of 5 recent positions and 1 sink: drafts longer than the window.
    config = KVConfig(layout="ring", max_seqs=3, max_context=32, ring_window=5, sinks=1)


class MixedSpeculativeMachine(SpeculativePoolMachine):
    # Layer 0 is full attention (cell), layer 1 a sliding window of 6 (ring).
    info = dataclasses.replace(INFO, sliding_window=(None, 6))


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestCellSpeculative = SpeculativePoolMachine.TestCase
TestCellSpeculative.settings = SETTINGS
TestFlatSpeculative = FlatSpeculativeMachine.TestCase
TestFlatSpeculative.settings = SETTINGS
TestRingSpeculative = RingSpeculativeMachine.TestCase
TestRingSpeculative.settings = SETTINGS
TestMixedSpeculative = MixedSpeculativeMachine.TestCase
TestMixedSpeculative.settings = SETTINGS


def test_a_rejected_ring_row_leaves_the_window_intact() -> None:
    """A draft as long as the window, all rejected: the ring holds what it held before."""
    config = KVConfig(layout="ring", max_seqs=1, max_context=32, ring_window=4, sinks=0)
    pool = KVPool(INFO, config)
    pool.reserve(0, 32)

    def step(start: int, n: int, value: float) -> None:
        batch = StepBatch.single(start, n, 0)
        pool.begin_step(batch)
        keys = torch.full((n, 1, 4), value) + torch.arange(n).view(-1, 1, 1)
        qkv = torch.cat([torch.zeros(n, 8), keys.flatten(1), keys.flatten(1)], 1)
        for layer in range(INFO.n_layers):
            pool.update_and_attend(layer, qkv, batch)

    step(0, 10, 100.0)
    ring = [g.keys[0].data.clone() for g in pool.groups]
    held = pool.hold_tentative(0, 11, 14)
    step(10, 4, -1.0)  # position 10 is kept; 11..13 wrap over the cells of 7, 8 and 9
    pool.roll_back(held, 11)
    pool.check_integrity()
    assert pool.length(0) == 11 and pool.sessions[0].high_water == 11
    group = pool.groups[0]
    cells = group.cell_index(pool.sessions[0], torch.arange(7, 11))  # the whole ring row
    expected = torch.tensor([107.0, 108.0, 109.0, -1.0])  # positions 7, 8, 9, then 10
    assert torch.equal(group.keys[0].data[cells][:, 0, 0], expected)
    assert not torch.equal(group.keys[0].data, ring[0])  # position 10 was written


def test_a_draft_longer_than_the_window_is_refused() -> None:
    """A ring writes only the last ``window`` rows of a step: a longer speculative step
    could not keep its first rows, so it is refused before anything is written."""
    config = KVConfig(layout="ring", max_seqs=1, max_context=32, ring_window=4, sinks=0)
    pool = KVPool(INFO, config)
    pool.reserve(0, 32)
    assert pool.tentative_span == 4
    with pytest.raises(SessionError, match="draft at most 3 tokens"):
        pool.hold_tentative(0, 1, 5)
    pool.hold_tentative(0, 1, 4)
