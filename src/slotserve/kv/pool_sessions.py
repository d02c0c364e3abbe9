"""`SessionPool`: the pool's sessions and steps, the first job of `slotserve.kv.pool.KVPool`.

It owns every layer's K/V storage (grouped by layout), the session table, the slot rows and
the block allocator. Sessions are bound by `reserve`, grown by `extend`, forked by `clone`
(copy-on-write for cell blocks), shortened by `rewind` and unbound by `release`. Every
operation either completes or raises a typed error having changed nothing. A step is
validated and committed by `begin_step`; the model then sees only `update_and_attend`.

A speculative step writes positions that may be rejected: `hold_tentative` (before the
step) records what a rejection must restore and `roll_back` (after it) keeps the accepted
positions. Flat and cell rows past a session's length are never read, so shortening the
length undoes them; a ring's rejected rows overwrote cells the window may still need, so
`hold_tentative` copies those cells first and `roll_back` writes them back.

The snapshot table (``snapshots``) is declared here because snapshots hold blocks and
parked slots, which the slot and copy-on-write accounting counts; making and dropping them
is `slotserve.kv.pool_snapshots`'s job.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from slotserve.errors import ContextOverflow, KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv.allocator import BlockAllocator
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.holdings import Holding, PoolHoldings, RowGroup, row_cells
from slotserve.kv.layouts import CellGroup, FlatGroup, PrefixGroup, RingGroup
from slotserve.kv.placement import build_groups
from slotserve.kv.plan import StepPlan
from slotserve.kv.session import SessionKV
from slotserve.kv.storage import KVStorage
from slotserve.native.attention import AttentionCalls, AttentionKernel


@dataclass(frozen=True)
class PoolUsage:
    """KV units free and in use; ``unit`` is "blocks" (cell layout) or "rows" (slots).
    ``parked`` of the ``used`` are held by snapshots alone (no live session holds them): a
    parked slot's row, or cell blocks only the prefix cache keeps. They are reclaimable,
    not leaked: the cache drops them when a request needs the room."""

    unit: str
    free: int
    used: int
    parked: int = 0


@dataclass(frozen=True)
class TentativeRows:
    """What `KVPool.roll_back` needs to undo a speculative step of ``session``: its length
    and high-water mark before the step, the first position the step may reject
    (``from_position``; those before it are kept whatever happens), and copies of the ring
    cells positions ``from_position .. end - 1`` overwrite (one (cells, data, scales) triple
    per ring storage, `KVPool._row_storages` order; empty without rings)."""

    session: int
    length: int
    high_water: int
    from_position: int
    end: int
    rings: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], ...]


class SessionPool:
    """K/V storage for up to ``max_seqs`` sessions of up to ``max_context`` positions: its
    sessions and their steps (`slotserve.kv.pool.KVPool` is the whole pool)."""

    def __init__(
        self, info: ModelInfo, config: KVConfig, attention: AttentionKernel | None = None
    ) -> None:
        self.info, self.config = info, config
        self.groups = build_groups(info, config, attention)
        # Each layer's group, and that group's place in `groups` (and in a `StepPlan`).
        self._group_of = {layer: (i, g) for i, g in enumerate(self.groups) for layer in g.layers}
        self._cells = [g for g in self.groups if isinstance(g, CellGroup)]
        self._rings = [g for g in self.groups if isinstance(g, RingGroup)]
        self._flats = [g for g in self.groups if isinstance(g, FlatGroup)]
        self.blocks = BlockAllocator(config.total_blocks if self._cells else 0)
        self.sessions: dict[int, SessionKV] = {}
        # Read-only snapshots (slot -1, or a parked slot): block holders that no step can
        # name or write (`slotserve.kv.pool_snapshots` makes and drops them).
        self.snapshots: dict[int, SessionKV] = {}
        self._free_slots = list(range(config.max_seqs - 1, -1, -1))
        # Every layer's attention as the compiled kernel's calls, for halves that run a
        # step's layers in C (`attention_calls`): None where a layer's attention is more
        # than that one call (the torch path, or a ring, which copies the rows it keeps).
        self._compiled = self._compiled_attention()

    # -- sizes -------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of all K/V storage (measured from the tensors): what the plan reserves."""
        return sum(g.nbytes for g in self.groups)

    @property
    def resident_bytes(self) -> int:
        """What of `nbytes` the process holds: storage pages become resident only when a
        cell on them is first written (`slotserve.kv.storage.zeros_on_write`)."""
        return sum(g.resident_bytes for g in self.groups)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def usage(self) -> PoolUsage:
        """Free and used KV units: cell blocks with the cell layout, else slot rows (a
        parked slot is used, as a snapshot's blocks are, and counted in ``parked`` too)."""
        if self._cells:
            return PoolUsage(
                "blocks", self.blocks.n_free, self.blocks.n_used, self.snapshot_only_blocks
            )
        parked = self.parked_slots
        return PoolUsage("rows", self.free_slots, len(self.sessions) + parked, parked)

    def session_ids(self) -> set[int]:
        return set(self.sessions)

    def slot_of(self, session: int) -> int:
        """The slot row ``session`` is bound to."""
        return self._get(session).slot

    def holdings(self) -> PoolHoldings:
        """Every session (by id) and snapshot (by id) with the exact cells it holds: its
        block table and each block's refcount, its row in each flat or ring group. A copy:
        later changes to the pool do not show in it."""
        rows = tuple(
            RowGroup("ring", tuple(g.layers), g.row)
            if isinstance(g, RingGroup)
            else RowGroup("flat", tuple(g.layers), self.config.max_context)
            for g in self.groups
            if not isinstance(g, CellGroup)
        )

        def holding(session: int, bound: SessionKV) -> Holding:
            refcounts = tuple(self.blocks.refcount[b] for b in bound.table)
            cells = () if bound.slot < 0 else tuple(row_cells(g, bound) for g in rows)
            slot = None if bound.slot < 0 else bound.slot
            blocks = tuple(bound.table)
            return Holding(session, slot, bound.length, bound.capacity, blocks, refcounts, cells)

        return PoolHoldings(
            self.config.block_size if self._cells else None,
            rows,
            tuple(holding(k, self.sessions[k]) for k in sorted(self.sessions)),
            tuple(holding(k, self.snapshots[k]) for k in sorted(self.snapshots)),
        )

    @property
    def parked_slots(self) -> int:
        """Slots that snapshots hold (parked); each is freed when its snapshot is dropped."""
        return sum(1 for s in self.snapshots.values() if s.slot >= 0)

    @property
    def snapshot_only_blocks(self) -> int:
        """Cell blocks that snapshots hold and no live session does (0 without cells)."""
        in_sessions = {b for bound in self.sessions.values() for b in bound.table}
        return len({b for frozen in self.snapshots.values() for b in frozen.table} - in_sessions)

    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.config.block_size) if self._cells else 0

    # -- binding -----------------------------------------------------------------------

    def reserve(self, session: int, n_tokens: int) -> None:
        """Bind ``session`` with room for ``n_tokens`` positions: all of it or nothing."""
        if session in self.sessions:
            raise SessionError(f"session {session} already holds a reservation; use extend()")
        self._check_context(n_tokens)
        if not self._free_slots:
            raise KVExhausted("session slots", 1, 0, f"max_seqs={self.config.max_seqs}")
        table = self._allocate(self._blocks_for(n_tokens))
        self.sessions[session] = SessionKV(self._free_slots.pop(), n_tokens, 0, table)

    def extend(self, session: int, n_more: int) -> None:
        """Grow a reservation by ``n_more`` positions: all of it or nothing."""
        bound = self._get(session)
        if n_more < 0:
            raise ValueError(f"extend by n_more={n_more}; must be >= 0")
        self._check_context(bound.capacity + n_more)
        need = self._blocks_for(bound.capacity + n_more) - len(bound.table)
        bound.table.extend(self._allocate(need))
        bound.capacity += n_more

    def release(self, session: int) -> None:
        """Return every block and the slot of ``session``."""
        bound = self._get(session)
        del self.sessions[session]
        self.blocks.drop(bound.table)
        self._free_slots.append(bound.slot)

    def clone(self, session: int, upto: int, into: int | None = None) -> int:
        """A new session holding the first ``upto`` committed positions of ``session``:
        cell blocks are shared copy-on-write, flat/ring rows are copied. Returns its id."""
        source = self._get(session)
        new_id = into if into is not None else max(self.sessions, default=-1) + 1
        if new_id in self.sessions:
            raise SessionError(f"session {new_id} already exists")
        if not 0 <= upto <= source.length:
            raise SessionError(
                f"clone upto={upto} is past session {session}'s committed length {source.length}"
            )
        self._check_ring_truncation(source.high_water, upto, "clone")
        if not self._free_slots:
            raise KVExhausted("session slots", 1, 0, f"max_seqs={self.config.max_seqs}")
        shared = source.table[: self._blocks_for(upto)]
        clone = SessionKV(self._free_slots[-1], upto, upto, list(shared), source.high_water)
        self._check_cow_room({**self.sessions, new_id: clone})
        self._free_slots.pop()
        self.blocks.share(shared)
        self.sessions[new_id] = clone
        for group in self.groups:
            if not isinstance(group, CellGroup):
                group.copy_positions(source, clone, upto)
        return new_id

    def rewind(self, session: int, n: int) -> None:
        """Drop the last ``n`` committed positions (the reservation is kept)."""
        bound = self._get(session)
        if not 0 <= n <= bound.length:
            raise SessionError(f"rewind n={n} outside 0..{bound.length} for session {session}")
        self._check_ring_truncation(bound.high_water, bound.length - n, "rewind")
        old = bound.length
        bound.length -= n
        try:
            self._check_cow_room(self.sessions)
        except KVExhausted:
            bound.length = old
            raise

    def length(self, session: int) -> int:
        return self._get(session).length

    # -- speculative steps -------------------------------------------------------------

    @property
    def tentative_span(self) -> int:
        """The most rows one session's step may append and still be rolled back: a ring
        writes only the last ``window`` rows of a step, so a longer step would leave a kept
        row unwritten (``max_context`` without rings)."""
        return min((ring.window for ring in self._rings), default=self.config.max_context)

    def hold_tentative(self, session: int, from_position: int, end: int) -> TentativeRows:
        """Before a step that appends up to position ``end - 1`` of ``session`` and may
        reject positions ``from_position ..`` of it: what `roll_back` restores. Call it
        before `begin_step`, while the storage still holds what those positions would
        overwrite; it changes nothing in the pool."""
        bound = self._get(session)
        if not bound.length <= from_position <= end <= bound.capacity:
            raise SessionError(
                f"tentative positions {from_position}..{end - 1} of session {session} must lie "
                f"between its length {bound.length} and its reservation {bound.capacity}"
            )
        if end - bound.length > self.tentative_span:
            raise SessionError(
                f"a step of {end - bound.length} rows for session {session} cannot be rolled "
                f"back: a ring keeps only the last {self.tentative_span} rows a step writes; "
                f"draft at most {self.tentative_span - 1} tokens"
            )
        rings = []
        positions = torch.arange(from_position, end)
        for group, storage in self._row_storages():
            if isinstance(group, RingGroup) and len(positions):
                cells = group.cell_index(bound, positions)
                scales = None if storage.scales is None else storage.scales[cells].clone()
                rings.append((cells, storage.data[cells].clone(), scales))
        return TentativeRows(
            session, bound.length, bound.high_water, from_position, end, tuple(rings)
        )

    def roll_back(self, held: TentativeRows, keep: int) -> None:
        """After the step `hold_tentative` prepared: keep ``session``'s first ``keep``
        positions (at least ``from_position``, at most the step's end) and undo the rest:
        the length becomes ``keep``, each ring cell a rejected position overwrote gets its
        old contents back, and the high-water mark is what it would be had the step
        appended only up to ``keep``. The session must still be bound, stepped to ``end``."""
        bound = self._get(held.session)
        if bound.length != held.end or not held.from_position <= keep <= held.end:
            raise SessionError(
                f"roll_back of session {held.session} to {keep}: it holds {bound.length} "
                f"positions, the step appended {held.from_position}..{held.end - 1}"
            )
        if keep == held.end:
            return
        rejected = keep - held.from_position  # the first rejected row in the copies
        storages = [s for g, s in self._row_storages() if isinstance(g, RingGroup)]
        for storage, (cells, data, scales) in zip(storages, held.rings, strict=True):
            # Where two rejected positions share a cell (a draft longer than the window),
            # the earliest's copy is the cell's old contents: write the copies back to front.
            for row in _restore_order(cells, rejected):
                storage.data.index_copy_(0, cells[row], data[row])
                if scales is not None:
                    assert storage.scales is not None
                    storage.scales.index_copy_(0, cells[row], scales[row])
        bound.length = keep
        bound.high_water = max(held.high_water, keep)

    # -- the step ----------------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> None:
        """Validate a step, un-share cell blocks it will write, build its `StepPlan` (set
        as ``batch.plan``: what every layer's `update_and_attend` reads) and commit its
        lengths.

        Raises (changing nothing) if a session is unknown, the step does not append at the
        session's length, or it would pass the session's reservation.
        """
        for session, start, end in zip(batch.sessions, batch.starts, batch.ends, strict=True):
            bound = self._get(session)
            if start != bound.length:
                raise SessionError(
                    f"session {session} holds {bound.length} positions; a step must append at "
                    f"{bound.length}, not {start}"
                )
            if end > bound.capacity:
                raise ContextOverflow(end, bound.capacity, "reserve or extend the session first")
        stepped = [self.sessions[session] for session in batch.sessions]
        for bound, start, end in zip(stepped, batch.starts, batch.ends, strict=True):
            self._unshare(bound, start, end)
        # The plan reads the block tables (un-shared above) and slots, not the lengths.
        heads = self.info.n_heads
        plans = tuple(group.plan(batch, self.sessions, heads) for group in self.groups)
        batch.plan = StepPlan(self, plans)
        for bound, end in zip(stepped, batch.ends, strict=True):
            bound.length = end
            bound.high_water = max(bound.high_water, end)

    def update_and_attend(self, layer: int, qkv: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Write the step's K/V for ``layer`` and attend, on the plan `begin_step` gave
        ``batch``; see `slotserve.kv.KVStore`."""
        index, group = self._group_of[layer]
        return group.update_and_attend(layer, qkv, batch, self._plan(batch).groups[index])

    def attention_calls(
        self, batch: StepBatch, qkv: torch.Tensor, heads: int, out: torch.Tensor
    ) -> AttentionCalls | None:
        """Every layer's `update_and_attend` of this step as the compiled kernel's calls, each
        reading ``qkv`` (the layer's fused rows, there when it runs) and writing ``out``
        (`slotserve.kv.store.CompiledAttention`); None where a layer's attention is more
        than that one call: the torch path, or a ring, which copies the rows it keeps
        after attending."""
        if self._compiled is None:
            return None
        plan = self._plan(batch)
        for group, group_plan in zip(self.groups, plan.groups, strict=True):
            assert isinstance(group, PrefixGroup)
            group.set_attends(group_plan, qkv, heads, out)
        return self._compiled

    def _compiled_attention(self) -> AttentionCalls | None:
        """The calls `attention_calls` hands out, their arguments set each step (None
        where some layer's attention is more than one kernel call)."""
        groups = [g for g in self.groups if isinstance(g, PrefixGroup)]
        attends = [g.attends for g in groups if g.attends is not None]
        if not groups or len(attends) != len(self.groups):
            return None
        kernel = groups[0].kernel
        assert kernel is not None
        addresses = {k: v for a in attends for k, v in a.addresses.items()}
        layers = [addresses[layer] for layer in range(self.info.n_layers)]
        return AttentionCalls(kernel.address, (ctypes.c_void_p * len(layers))(*layers))

    def _plan(self, batch: StepBatch) -> StepPlan:
        """The plan this pool's `begin_step` gave ``batch``."""
        plan = batch.plan
        if plan is None or plan.owner is not self:
            raise SessionError(
                f"a step of sessions {batch.sessions} was not begun in this pool: call "
                "begin_step(batch) on it before the model runs the step"
            )
        return plan

    # -- internals ---------------------------------------------------------------------

    def _get(self, session: int) -> SessionKV:
        if session not in self.sessions:
            raise SessionError(f"unknown session {session} (never reserved, or released)")
        return self.sessions[session]

    def _check_context(self, n_tokens: int) -> None:
        if n_tokens < 0:
            raise ValueError(f"n_tokens={n_tokens} must be >= 0")
        if n_tokens > self.config.max_context:
            raise ContextOverflow(n_tokens, self.config.max_context, "raise max_context")

    def _check_ring_truncation(self, high_water: int, new_length: int, what: str) -> None:
        for ring in self._rings:
            if not ring.can_truncate(high_water, new_length):
                raise SessionError(
                    f"{what} to {new_length} positions needs positions that have left the "
                    f"ring (window {ring.window}, written up to {high_water}); use the flat "
                    "or cell layout"
                )

    def _allocate(self, n_blocks: int) -> list[int]:
        """Blocks for a reservation, leaving enough free for every pending copy-on-write."""
        spare = self.blocks.n_free - self._cow_needed(self.sessions)
        if n_blocks > spare:
            raise KVExhausted(
                "KV blocks", n_blocks, max(spare, 0), "release sessions or add blocks"
            )
        return self.blocks.allocate(n_blocks)

    def _cow_needed(
        self, sessions: dict[int, SessionKV], snapshots: dict[int, SessionKV] | None = None
    ) -> int:
        """Blocks that copy-on-write may still take: for each shared block, one per holder
        that may still write into it, at most refcount - 1. Snapshots (``self.snapshots``
        unless given) hold blocks but never write."""
        if not self._cells:
            return 0
        holders: dict[int, int] = {}
        writers: dict[int, int] = {}
        for frozen in (self.snapshots if snapshots is None else snapshots).values():
            for block in frozen.table:
                holders[block] = holders.get(block, 0) + 1
        bs = self.config.block_size
        for bound in sessions.values():
            for index, block in enumerate(bound.table):
                holders[block] = holders.get(block, 0) + 1
                if (index + 1) * bs > bound.length:
                    writers[block] = writers.get(block, 0) + 1
        return sum(min(writers.get(b, 0), n - 1) for b, n in holders.items() if n > 1)

    def _check_cow_room(
        self, sessions: dict[int, SessionKV], snapshots: dict[int, SessionKV] | None = None
    ) -> None:
        needed = self._cow_needed(sessions, snapshots)
        if needed > self.blocks.n_free:
            raise KVExhausted(
                "KV blocks (held back for copy-on-write)",
                needed,
                self.blocks.n_free,
                "release sessions or add blocks",
            )

    def _unshare(self, bound: SessionKV, start: int, end: int) -> None:
        """Copy-on-write: give ``bound`` its own copy of each shared block it will write."""
        if not self._cells:
            return
        bs = self.config.block_size
        for index in range(start // bs, (end - 1) // bs + 1):
            block = bound.table[index]
            if self.blocks.refcount[block] > 1:
                (fresh,) = self.blocks.allocate(1)
                for group in self._cells:
                    group.copy_block(block, fresh)
                self.blocks.drop([block])
                bound.table[index] = fresh

    def _row_storages(self) -> list[tuple[RingGroup | FlatGroup, KVStorage]]:
        groups: list[RingGroup | FlatGroup] = [*self._rings, *self._flats]
        return [(g, s) for g in groups for s in (*g.keys.values(), *g.values.values())]

    # -- checks ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert every invariant of the sessions, slots and blocks (tests call it after
        every operation)."""
        parked = [s.slot for s in self.snapshots.values() if s.slot >= 0]
        slots = [s.slot for s in self.sessions.values()] + parked
        assert len(set(slots)) == len(slots), "two sessions (or parked snapshots) share a slot"
        assert sorted(slots + self._free_slots) == list(range(self.config.max_seqs)), "slot leak"
        for sid, bound in self.sessions.items():
            assert 0 <= bound.length <= bound.capacity <= self.config.max_context, sid
            assert len(bound.table) == self._blocks_for(bound.capacity), f"table size {sid}"
        for sid, frozen in self.snapshots.items():
            assert sid not in self.sessions, f"snapshot {sid} is also a session"
            assert 0 < frozen.length == frozen.capacity, f"snapshot {sid} length"
            assert len(frozen.table) == self._blocks_for(frozen.capacity), f"table size {sid}"
        tables = [s.table for s in (*self.sessions.values(), *self.snapshots.values())]
        self.blocks.check_integrity(tables)
        assert self._cow_needed(self.sessions) <= self.blocks.n_free, "copy-on-write overcommitted"


def _restore_order(cells: torch.Tensor, first: int) -> list[slice]:
    """Rows ``first ..`` of ``cells`` as runs to write back in order: the whole tail at
    once when its cells are distinct, else one row at a time, last row first."""
    tail = cells[first:]
    if len(torch.unique(tail)) == len(tail):
        return [slice(first, len(cells))]
    return [slice(row, row + 1) for row in range(len(cells) - 1, first - 1, -1)]
