"""KVPool under thousands of random operations (hypothesis state machine): every invariant
holds after every step, stored K/V is exactly what each session wrote (copy-on-write
isolates clones), failed operations change nothing, and releasing all returns to baseline."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slotserve.errors import ContextOverflow, KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import build_kernels

INFO = ModelInfo(
    arch="llama",
    n_layers=2,
    dim=16,
    n_heads=2,
    n_kv_heads=1,
    head_dim=4,
    ffn_dim=32,
    vocab_size=50,
    max_context=32,
)
SESSION_IDS = st.integers(0, 6)


def snapshot(pool: KVPool) -> Any:
    return (
        sorted(pool.blocks.free),
        list(pool.blocks.refcount),
        {s: (b.slot, b.capacity, b.length, list(b.table)) for s, b in pool.sessions.items()},
        pool.free_slots,
    )


class PoolMachine(RuleBasedStateMachine):
    config = KVConfig(layout="cell", max_seqs=4, max_context=32, block_size=4, num_blocks=18)
    info = INFO

    def __init__(self) -> None:
        super().__init__()
        # Decode-sized writes take the compiled kernel where it builds, the others torch.
        self.pool = KVPool(self.info, self.config, attention=build_kernels().attention)
        self.written: dict[int, torch.Tensor] = {}  # layer-0 keys each session committed
        self.counter = 0

    def _unchanged_after_failure(self, op: Any, *errors: type[Exception]) -> bool:
        before = snapshot(self.pool)
        try:
            op()
        except errors:
            assert snapshot(self.pool) == before, "a failed operation changed the pool"
            return False
        return True

    @rule(session=SESSION_IDS, n=st.one_of(st.integers(1, 12), st.integers(0, 40)))
    def reserve(self, session: int, n: int) -> None:
        errors = (KVExhausted, ContextOverflow, SessionError)
        if self._unchanged_after_failure(lambda: self.pool.reserve(session, n), *errors):
            self.written[session] = torch.zeros(0, 1, 4)

    @rule(session=SESSION_IDS, n=st.integers(0, 20))
    def extend(self, session: int, n: int) -> None:
        errors = (KVExhausted, ContextOverflow, SessionError)
        self._unchanged_after_failure(lambda: self.pool.extend(session, n), *errors)

    @precondition(lambda self: self.written)
    @rule(data=st.data(), n=st.integers(1, 6))
    def write(self, data: st.DataObject, n: int) -> None:
        self._append(data.draw(st.sampled_from(sorted(self.written))), n)

    def _append(self, session: int, n: int) -> None:
        start = self.pool.length(session)
        batch = StepBatch.single(start, n, session)
        if not self._unchanged_after_failure(lambda: self.pool.begin_step(batch), ContextOverflow):
            return
        self.counter += 1
        keys = torch.full((n, 1, 4), float(self.counter)) + torch.arange(n).view(-1, 1, 1) / 100
        q = torch.zeros(n, 2, 4)
        qkv = torch.cat([q.flatten(1), keys.flatten(1), keys.flatten(1)], 1)
        for layer in range(self.info.n_layers):
            self.pool.update_and_attend(layer, qkv, batch)
        stored = keys.to(self.config.torch_dtype).float()  # the default dtype's rounding
        self.written[session] = torch.cat([self.written[session], stored])

    @precondition(lambda self: any(len(w) for w in self.written.values()))
    @rule(data=st.data(), into=SESSION_IDS)
    def clone(self, data: st.DataObject, into: int) -> None:
        session = data.draw(st.sampled_from(sorted(s for s, w in self.written.items() if len(w))))
        upto = data.draw(st.integers(0, self.pool.length(session) + 2))
        errors = (KVExhausted, SessionError)
        if self._unchanged_after_failure(lambda: self.pool.clone(session, upto, into), *errors):
            self.written[into] = self.written[session][:upto].clone()
            # A clone usually goes on to generate: give it room, so its writes into shared
            # blocks are exercised.
            room = data.draw(st.integers(0, 8))
            grow = (KVExhausted, ContextOverflow)
            self._unchanged_after_failure(lambda: self.pool.extend(into, room), *grow)
            for writer in data.draw(st.lists(st.sampled_from([session, into]), max_size=2)):
                self._append(writer, data.draw(st.integers(1, 4)))

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.written)))
        n = data.draw(st.integers(0, self.pool.length(session) + 2))
        if self._unchanged_after_failure(
            lambda: self.pool.rewind(session, n), KVExhausted, SessionError
        ):
            self.written[session] = self.written[session][: self.pool.length(session)]

    @rule(session=SESSION_IDS)
    def release(self, session: int) -> None:
        if self._unchanged_after_failure(lambda: self.pool.release(session), SessionError):
            del self.written[session]
        else:
            assert session not in self.written

    @rule()
    def release_all_returns_to_baseline(self) -> None:
        for session in list(self.written):
            self.pool.release(session)
        self.written.clear()
        assert self.pool.blocks.n_free == self.pool.blocks.total
        assert self.pool.free_slots == self.config.max_seqs
        assert not self.pool.sessions

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        assert self.pool.blocks.n_free + self.pool.blocks.n_used == self.pool.blocks.total

    @invariant()
    def contents(self) -> None:
        for group in self.pool.groups:
            for session, expected in self.written.items():
                bound = self.pool.sessions[session]
                positions = group.visible_positions(bound.length)
                cells = group.cell_index(bound, positions)
                for layer in group.layers:
                    stored = group.keys[layer].gather(cells)
                    torch.testing.assert_close(stored, expected[positions], rtol=0, atol=0)


class FlatPoolMachine(PoolMachine):
    config = KVConfig(layout="flat", max_seqs=3, max_context=32)


class MixedPoolMachine(PoolMachine):
    # Layer 0 is full attention (cell), layer 1 a sliding window of 6 (ring).
    info = dataclasses.replace(INFO, sliding_window=(None, 6))


SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestCellPool = PoolMachine.TestCase
TestCellPool.settings = SETTINGS
TestFlatPool = FlatPoolMachine.TestCase
TestFlatPool.settings = SETTINGS
TestMixedPool = MixedPoolMachine.TestCase
TestMixedPool.settings = SETTINGS
