"""`KVPool`: the one KV cache of an engine, allocated once and never grown.

It owns every layer's K/V storage (grouped by layout), the session table, the slot rows and
the block allocator. Sessions are bound by `reserve`, grown by `extend`, forked by `clone`
(copy-on-write for cell blocks), shortened by `rewind` and unbound by `release`. Every
operation either completes or raises a typed error having changed nothing. The model sees
only `update_and_attend`.

Snapshots are read-only holders of KV that no step can write: `publish` freezes a
session's first positions into one, `release_into` turns a finished session into one,
`reserve_from` binds a new session that starts from a snapshot, `drop_snapshot` lets it go.
In a cell pool a snapshot holds blocks (shared copy-on-write) and no slot (the ``max_seqs``
ceiling is for live sessions). The sliding-window layers of a cell pool, and every layer of
the ring layout, keep a ring row per slot, not blocks: a snapshot keeps a copy of its
session's ring rows (outside the pool's storage), and `retains` says whether those rows
still hold what a restore from a given position needs (a ring that has wrapped past it
does not; `reserve_from` refuses it). A pool with flat rows parks instead
(`parks_slots`): `release_into` keeps the finished session's slot as the snapshot, its rows
where they are, so nothing is copied or allocated; `reserve_from` consuming it hands the
slot itself to the new session, and one that does not copies its rows into a free slot
inside the pool. A parked slot is no live session's: dropping the snapshot frees it, and
the prefix cache drops parked snapshots before a request waits for a slot.

A snapshot's payload, for the prefix cache's disk tier: `payload_parts` names its tensors
and their shapes, `payload_of` captures a snapshot's block table and row copies (by whoever
drives the pool), `read_payload` copies its cells out (from another thread too: a
snapshot's blocks are never written while it holds them), and `load_payload` writes one
into a freshly reserved session: `write_payload` (from another thread too, while whoever
drives the pool neither steps nor releases that session) then `commit_payload`.

A speculative step writes positions that may be rejected: `hold_tentative` (before the
step) records what a rejection must restore and `roll_back` (after it) keeps the accepted
positions. Flat and cell rows past a session's length are never read, so shortening the
length undoes them; a ring's rejected rows overwrote cells the window may still need, so
`hold_tentative` copies those cells first and `roll_back` writes them back.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from slotserve.errors import ContextOverflow, KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv.allocator import BlockAllocator
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.holdings import Holding, PoolHoldings, RowGroup, row_cells
from slotserve.kv.layouts import CellGroup, FlatGroup, LayerGroup, PrefixGroup, RingGroup
from slotserve.kv.placement import build_groups
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
class PayloadPart:
    """One tensor of a snapshot's payload (`KVPool.payload_parts`), in payload order:
    ``name`` (layer, K or V, ``.scales`` for int8 scales), its dtype (``torch.float32``,
    ...) and its shape: ``(positions, *tail)`` for a cell or flat layer (one row a
    position), ``(rows, *tail)`` for a ring (the snapshot's copy of its whole row)."""

    name: str
    dtype: str
    rows: int | None  # None: one row a position
    tail: tuple[int, ...]

    def shape(self, length: int) -> tuple[int, ...]:
        return (length if self.rows is None else self.rows, *self.tail)


@dataclass(frozen=True)
class SnapshotPayload:
    """What `KVPool.read_payload` copies out of one snapshot, as `KVPool.payload_of`
    captured it: its length and high-water mark, its block table and its row copies
    (tensors the pool never writes)."""

    length: int
    high_water: int
    table: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]


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


class KVPool:
    """K/V storage for up to ``max_seqs`` sessions of up to ``max_context`` positions."""

    def __init__(
        self, info: ModelInfo, config: KVConfig, attention: AttentionKernel | None = None
    ) -> None:
        self.info, self.config = info, config
        self.groups = build_groups(info, config, attention)
        self._group_of = {layer: g for g in self.groups for layer in g.layers}
        self._cells = [g for g in self.groups if isinstance(g, CellGroup)]
        self._rings = [g for g in self.groups if isinstance(g, RingGroup)]
        self._flats = [g for g in self.groups if isinstance(g, FlatGroup)]
        self.blocks = BlockAllocator(config.total_blocks if self._cells else 0)
        self.sessions: dict[int, SessionKV] = {}
        # Read-only snapshots (slot -1): block holders that no step can name or write.
        self.snapshots: dict[int, SessionKV] = {}
        # Each snapshot's copy of its session's ring rows, whole (a pool with flat rows
        # parks instead); one (data, int8 scales) pair per storage, in `_row_storages` order.
        self._snapshot_rings: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._free_slots = list(range(config.max_seqs - 1, -1, -1))
        self._attention_calls: AttentionCalls | None = None  # made at the first step asking

    # -- sizes -----------------------------------------------------------------------

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

    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.config.block_size) if self._cells else 0

    # -- binding ---------------------------------------------------------------------

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

    # -- speculative steps -----------------------------------------------------------

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

    # -- snapshots (cell layout) -----------------------------------------------------

    @property
    def supports_snapshots(self) -> bool:
        """True for every layout with layers: a snapshot is block references (cell layers)
        plus a copy of its session's ring rows (sliding-window layers, or every layer of
        the ring layout), or a parked slot (`parks_slots`)."""
        return bool(self.groups)

    @property
    def parks_slots(self) -> bool:
        """True with flat rows (the flat layout): `release_into` parks the finished
        session's slot as its snapshot instead of copying its positions out of the pool
        (a flat copy would be up to a whole context's rows a snapshot)."""
        return bool(self._flats)

    @property
    def parked_slots(self) -> int:
        """Slots that snapshots hold (parked); each is freed when its snapshot is dropped."""
        return sum(1 for s in self.snapshots.values() if s.slot >= 0)

    @property
    def snapshot_only_blocks(self) -> int:
        """Cell blocks that snapshots hold and no live session does (0 without cells)."""
        in_sessions = {b for bound in self.sessions.values() for b in bound.table}
        return len({b for frozen in self.snapshots.values() for b in frozen.table} - in_sessions)

    def snapshot_copied_nbytes(self, snapshot: int) -> int:
        """Bytes ``snapshot``'s copies of row-group cells hold outside the pool (0 for a
        parked slot, or a cell pool without sliding-window layers)."""
        self._get_snapshot(snapshot)
        copies = self._snapshot_rings.get(snapshot, [])
        return sum(t.numel() * t.element_size() for pair in copies for t in pair if t is not None)

    @property
    def snapshot_ring_nbytes(self) -> int:
        """Bytes of the ring rows one snapshot copies (0 without sliding-window layers)."""
        return sum(g.nbytes for g in self._rings) // max(self.config.max_seqs, 1)

    @property
    def snapshot_copy_nbytes(self) -> int:
        """Bytes one snapshot copies out of the pool: its ring rows, or nothing where the
        pool parks slots (its cell blocks are shared, not copied: see `block_nbytes`)."""
        return 0 if self.parks_slots else self.snapshot_ring_nbytes

    def retains(self, snapshot: int, upto: int) -> bool:
        """Whether every layer of ``snapshot`` still holds what a session restored from its
        first ``upto`` positions needs: cell layers keep every position; a sliding-window
        ring written up to the snapshot's end keeps only its last window, which serves
        ``upto`` only near that end (or if it never wrapped)."""
        frozen = self._get_snapshot(snapshot)
        return all(ring.can_truncate(frozen.high_water, upto) for ring in self._rings)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one cell block across every layer (K and V)."""
        return sum(g.nbytes for g in self._cells) // max(self.config.total_blocks, 1)

    def snapshot_ids(self) -> set[int]:
        return set(self.snapshots)

    def snapshot_blocks(self, snapshot: int) -> list[int]:
        """The blocks ``snapshot`` holds (a copy of its table)."""
        return list(self._get_snapshot(snapshot).table)

    def publish(self, session: int, upto: int, into: int) -> None:
        """Freeze the first ``upto`` committed positions of ``session`` as the read-only
        snapshot ``into``: its blocks are shared by refcount, not copied, and it takes no
        slot. The session keeps running; its next write into a now-shared block copies it
        (room for that copy is checked here: `KVExhausted`, nothing changed). A pool that
        `parks_slots` refuses (`SessionError`): a running session's flat rows could only be
        copied out of the pool; its slot is parked when it finishes (`release_into`)."""
        if self.parks_slots:
            raise SessionError(
                "publish: a pool with flat rows keeps snapshots only as parked slots; "
                "release_into the finished session instead"
            )
        source = self._snapshot_source(session, upto, into, "publish")
        shared = source.table[: self._blocks_for(upto)]
        snapshot = SessionKV(-1, upto, upto, list(shared), source.high_water)
        self._check_cow_room(self.sessions, {**self.snapshots, into: snapshot})
        self.blocks.share(shared)
        self.snapshots[into] = snapshot
        self._freeze_rings(source, into, upto)

    def reserve_from(
        self, session: int, n_tokens: int, snapshot: int, upto: int, *, consume: bool = False
    ) -> None:
        """`reserve` ``session`` for ``n_tokens`` positions whose first ``upto`` are those
        of ``snapshot`` (its blocks shared copy-on-write, the rest fresh): all or nothing.
        The session's length starts at ``upto``. With ``consume``, the snapshot is dropped
        in the same move: its blocks past ``upto`` that no one else holds count as free,
        and a block it shared only with the new session is no longer copied on write (a
        one-slot pool continuing a conversation needs exactly that room)."""
        self._check_snapshots_supported()
        if session in self.sessions or session in self.snapshots:
            raise SessionError(f"session {session} already holds a reservation; use extend()")
        self._check_context(n_tokens)
        source = self._get_snapshot(snapshot)
        if not 0 <= upto <= min(source.length, n_tokens):
            raise SessionError(
                f"restore upto={upto} is outside 0..{min(source.length, n_tokens)} "
                f"(snapshot {snapshot} holds {source.length}, the reservation {n_tokens})"
            )
        if not self.retains(snapshot, upto):
            raise SessionError(
                f"snapshot {snapshot} (written up to {source.high_water}) no longer holds what "
                f"a restore from {upto} needs: a sliding-window ring has wrapped past it"
            )
        parked = source.slot >= 0
        takes_slot = consume and parked  # the parked slot itself, its rows in place
        if not takes_slot and not self._free_slots:
            raise KVExhausted("session slots", 1, 0, f"max_seqs={self.config.max_seqs}")
        slot = source.slot if takes_slot else self._free_slots[-1]
        shared = source.table[: self._blocks_for(upto)]
        high_water = source.high_water if self._rings else upto
        bound = SessionKV(slot, n_tokens, upto, list(shared), high_water)
        fresh = self._blocks_for(n_tokens) - len(shared)
        others = {k: s for k, s in self.snapshots.items() if not (consume and k == snapshot)}
        freed = 0
        if consume:
            tail = source.table[len(shared) :]
            freed = sum(1 for block in tail if self.blocks.refcount[block] == 1)
        sessions = {**self.sessions, session: bound}
        spare = self.blocks.n_free + freed - self._cow_needed(sessions, others)
        if fresh > spare:
            raise KVExhausted("KV blocks", fresh, max(spare, 0), "release sessions or add blocks")
        self.blocks.share(shared)
        if not parked:
            self._thaw_rings(snapshot, bound, upto)
        elif not takes_slot:  # a copy inside the pool, parked slot to free slot
            for group in self.groups:
                if not isinstance(group, CellGroup):
                    group.copy_positions(source, bound, upto)
        if consume:
            self.drop_snapshot(snapshot)  # a parked slot goes back to the free list ...
        bound.table.extend(self.blocks.allocate(fresh))
        self._free_slots.remove(slot)  # ... and straight to the new session
        self.sessions[session] = bound

    def _snapshot_source(self, session: int, upto: int, into: int, what: str) -> SessionKV:
        """The running ``session`` whose first ``upto`` committed positions become the new
        snapshot ``into``, after the checks both ways of making one share."""
        self._check_snapshots_supported()
        source = self._get(session)
        if into in self.sessions or into in self.snapshots:
            raise SessionError(f"session {into} already exists")
        if not 0 < upto <= source.length:
            raise SessionError(
                f"{what} upto={upto} is outside 1..{source.length} (session {session}'s "
                "committed length)"
            )
        return source

    def release_into(self, session: int, upto: int, into: int) -> None:
        """`release` ``session``, keeping its first ``upto`` committed positions as the
        read-only snapshot ``into`` (its blocks, not copies; the rest go back to the free
        list). Nothing will be written into it, so it cannot fail for room: a finished
        request hands over its KV instead of freeing it. A pool that `parks_slots` keeps
        the session's slot as the snapshot's, nothing copied; another copies its ring rows."""
        source = self._snapshot_source(session, upto, into, "release_into")
        kept = source.table[: self._blocks_for(upto)]
        self.blocks.share(kept)
        if self.parks_slots:
            del self.sessions[session]
            self.blocks.drop(source.table)
            self.snapshots[into] = SessionKV(source.slot, upto, upto, list(kept), source.high_water)
            return
        self._freeze_rings(source, into, upto)
        self.release(session)
        self.snapshots[into] = SessionKV(-1, upto, upto, list(kept), source.high_water)

    def drop_snapshot(self, snapshot: int) -> None:
        """Let go of ``snapshot``: blocks no one else holds return to the free list."""
        frozen = self._get_snapshot(snapshot)
        del self.snapshots[snapshot]
        self._snapshot_rings.pop(snapshot, None)
        self.blocks.drop(frozen.table)
        if frozen.slot >= 0:
            self._free_slots.append(frozen.slot)

    # -- snapshot payloads (the prefix cache's disk tier) ------------------------------

    def kv_identity(self) -> dict[str, object]:
        """What a payload's bytes mean besides the model's: the layout, the storage dtype,
        the block size and every layer group's placement (JSON-able)."""
        groups = [
            {
                "kind": g.kind,
                "layers": list(g.layers),
                "window": getattr(g, "window", None),
                "sinks": getattr(g, "sinks", 0),
            }
            for g in self.groups
        ]
        return {
            "layout": self.config.layout,
            "dtype": self.config.dtype,
            "block_size": self.config.block_size,
            "kv_heads": self.info.n_kv_heads,
            "head_dim": self.info.head_dim,
            "groups": groups,
        }

    def _payload_storages(self) -> list[tuple[str, KVStorage, LayerGroup | None]]:
        """Every storage of a payload in order: each cell layer's K then V (group None:
        read through the block table), then the row groups' storages (`_row_storages`
        order, the order of a snapshot's row copies) with their group."""
        named: list[tuple[str, KVStorage, LayerGroup | None]] = []
        for cells in self._cells:
            for layer in cells.layers:
                named += [(f"L{layer}.k", cells.keys[layer], None)]
                named += [(f"L{layer}.v", cells.values[layer], None)]
        names = {
            id(s): f"L{layer}.{kv}"
            for g in self.groups
            for kv, storages in (("k", g.keys), ("v", g.values))
            for layer, s in storages.items()
        }
        named += [(names[id(s)], s, g) for g, s in self._row_storages()]
        return named

    def payload_parts(self) -> list[PayloadPart]:
        """The tensors of a snapshot's payload, in order (int8 scales after their data)."""
        parts = []
        for name, storage, group in self._payload_storages():
            rows = group.row if isinstance(group, RingGroup) else None
            tensors = [("", storage.data), (".scales", storage.scales)]
            for suffix, tensor in tensors:
                if tensor is not None:
                    tail = tuple(int(d) for d in tensor.shape[1:])
                    parts.append(PayloadPart(name + suffix, str(tensor.dtype), rows, tail))
        return parts

    def payload_of(self, snapshot: int) -> SnapshotPayload:
        """Capture what `read_payload` needs of ``snapshot`` (by whoever drives the pool)."""
        frozen = self._get_snapshot(snapshot)
        if frozen.slot >= 0:  # parked: views of its slot's cells, which no step writes
            copies = [
                t
                for group, storage in self._row_storages()
                for t in self._row_views(storage, group, frozen.slot, frozen.length)
            ]
        else:
            copies = [t for pair in self._snapshot_rings.get(snapshot, []) for t in pair]
        rows = tuple(t for t in copies if t is not None)
        return SnapshotPayload(frozen.length, frozen.high_water, tuple(frozen.table), rows)

    def read_payload(self, payload: SnapshotPayload) -> Iterator[torch.Tensor]:
        """The tensors of ``payload``, in `payload_parts` order, each copied out of the pool
        as it is asked for (one part's copy at a time, not the snapshot's). Safe from another
        thread while the snapshot lives (its blocks are never written); once it is dropped
        its blocks may be reused, so what a read overlapping that holds is void."""
        if self._cells:
            cells = self._block_cells(list(payload.table), payload.length)
            for _name, storage, group in self._payload_storages():
                if group is None:
                    yield storage.data[cells]
                    if storage.scales is not None:
                        yield storage.scales[cells]
        yield from payload.rows

    def load_payload(
        self, session: int, upto: int, high_water: int, parts: Iterable[torch.Tensor]
    ) -> None:
        """Write the first ``upto`` positions of a payload (and its ring rows) into
        ``session``, reserved and still empty, then commit them: its length becomes
        ``upto``, its high-water mark ``high_water`` (with rings; else ``upto``). If
        ``parts`` raises or does not match, nothing is committed (the session stays empty;
        what was written into its own cells is never read)."""
        self.write_payload(session, upto, parts)
        self.commit_payload(session, upto, high_water)

    def write_payload(self, session: int, upto: int, parts: Iterable[torch.Tensor]) -> None:
        """`load_payload` without the commit: the parts written into ``session``'s own
        cells, its length still 0. It reads the session's table and writes only its cells
        and slot rows, so it may run on another thread while whoever drives the pool
        neither steps ``session`` nor releases it (nothing reads what it writes until
        `commit_payload`)."""
        bound = self._get(session)
        self._check_loadable(session, bound, upto)
        cells = self._block_cells(bound.table, upto) if self._cells else None
        items = iter(parts)
        for _name, storage, group in self._payload_storages():
            if group is None:
                assert cells is not None
                where = cells
            else:
                assert isinstance(group, RingGroup | FlatGroup)
                where = self._copied_cells(group, bound.slot, upto)
            storage.data.index_copy_(0, where, next(items)[: len(where)])
            if storage.scales is not None:
                storage.scales.index_copy_(0, where, next(items)[: len(where)])
        if next(items, None) is not None:
            raise SessionError("load_payload: more parts than this pool's payload holds")

    def commit_payload(self, session: int, upto: int, high_water: int) -> None:
        """Commit the payload `write_payload` wrote into ``session``: its length becomes
        ``upto``, its high-water mark ``high_water`` (with rings; else ``upto``)."""
        bound = self._get(session)
        self._check_loadable(session, bound, upto)
        bound.length = upto
        bound.high_water = high_water if self._rings else upto

    @staticmethod
    def _check_loadable(session: int, bound: SessionKV, upto: int) -> None:
        if bound.length or not 0 < upto <= bound.capacity:
            raise SessionError(
                f"load_payload upto={upto} into session {session} (length {bound.length}, "
                f"capacity {bound.capacity}): it must be empty and hold upto positions"
            )

    def retains_from(self, high_water: int, upto: int) -> bool:
        """`retains` for a snapshot written up to ``high_water`` that this pool does not
        hold (a stored one): whether every ring still holds what a restore from ``upto``
        needs."""
        return all(ring.can_truncate(high_water, upto) for ring in self._rings)

    def _block_cells(self, table: list[int], length: int) -> torch.Tensor:
        """The cells of positions ``0 .. length - 1`` through block ``table``."""
        positions, bs = torch.arange(length), self.config.block_size
        return torch.tensor(table, dtype=torch.long)[positions // bs] * bs + positions % bs

    def _row_storages(self) -> list[tuple[RingGroup | FlatGroup, KVStorage]]:
        groups: list[RingGroup | FlatGroup] = [*self._rings, *self._flats]
        return [(g, s) for g in groups for s in (*g.keys.values(), *g.values.values())]

    def _copied_cells(self, group: RingGroup | FlatGroup, slot: int, length: int) -> torch.Tensor:
        """The cells of ``slot`` a snapshot of ``length`` positions copies in ``group``."""
        if isinstance(group, RingGroup):  # the whole ring: which cells are live is its state
            return torch.arange(slot * group.row, (slot + 1) * group.row)
        return torch.arange(slot * group.max_context, slot * group.max_context + length)

    @staticmethod
    def _row_views(
        storage: KVStorage, group: RingGroup | FlatGroup, slot: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views (not copies) of the cells `_copied_cells` names: data, then scales."""
        if isinstance(group, RingGroup):
            first, last = slot * group.row, (slot + 1) * group.row
        else:
            first = slot * group.max_context
            last = first + length
        scales = None if storage.scales is None else storage.scales[first:last]
        return storage.data[first:last], scales

    def _freeze_rings(self, source: SessionKV, into: int, upto: int) -> None:
        """Keep a copy of ``source``'s rings (whole) as snapshot ``into``'s (a pool with
        flat rows parks instead: it never copies)."""
        if not self._rings:
            return
        copies = []
        for group, storage in self._row_storages():
            cells = self._copied_cells(group, source.slot, upto)
            scales = None if storage.scales is None else storage.scales[cells].clone()
            copies.append((storage.data[cells].clone(), scales))
        self._snapshot_rings[into] = copies

    def _thaw_rings(self, snapshot: int, bound: SessionKV, upto: int) -> None:
        """Write snapshot ``snapshot``'s ring copies into ``bound``'s slot."""
        copies = self._snapshot_rings.get(snapshot, [])
        for (group, storage), (data, scales) in zip(self._row_storages(), copies, strict=True):
            cells = self._copied_cells(group, bound.slot, upto)
            data, scales = data[: len(cells)], None if scales is None else scales[: len(cells)]
            storage.data.index_copy_(0, cells, data)
            if scales is not None:
                assert storage.scales is not None
                storage.scales.index_copy_(0, cells, scales)

    def _get_snapshot(self, snapshot: int) -> SessionKV:
        if snapshot not in self.snapshots:
            raise SessionError(f"unknown snapshot {snapshot} (never published, or dropped)")
        return self.snapshots[snapshot]

    def _check_snapshots_supported(self) -> None:
        if not self.supports_snapshots:
            raise SessionError("snapshots need a pool with layers")

    # -- the step --------------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> None:
        """Validate a step, un-share cell blocks it will write, and commit its lengths.

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
        for session, start, end in zip(batch.sessions, batch.starts, batch.ends, strict=True):
            bound = self.sessions[session]
            self._unshare(bound, start, end)
            bound.length = end
            bound.high_water = max(bound.high_water, end)

    def update_and_attend(self, layer: int, qkv: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Write the step's K/V for ``layer`` and attend; see `slotserve.kv.KVStore`."""
        return self._group_of[layer].update_and_attend(layer, qkv, batch, self.sessions)

    def attention_calls(
        self, batch: StepBatch, qkv: torch.Tensor, heads: int, out: torch.Tensor
    ) -> AttentionCalls | None:
        """Every layer's `update_and_attend` of this step as the compiled kernel's calls, each
        reading ``qkv`` (the layer's fused rows, there when it runs) and writing ``out``
        (`slotserve.kv.store.CompiledAttention`); None where a layer's attention is more
        than that one call: the torch path, or a ring, which copies the rows it keeps
        after attending."""
        groups = [g for g in self.groups if isinstance(g, PrefixGroup)]
        if len(groups) != len(self.groups):
            return None
        attends = [g.set_attends(batch, self.sessions, qkv, heads, out) for g in groups]
        if any(a is None for a in attends):
            return None
        if self._attention_calls is None:
            kernel = groups[0].kernel
            assert kernel is not None
            addresses = {k: v for a in attends if a is not None for k, v in a.addresses.items()}
            layers = [addresses[layer] for layer in range(self.info.n_layers)]
            array = (ctypes.c_void_p * len(layers))(*layers)
            self._attention_calls = AttentionCalls(kernel.address, array)
        return self._attention_calls

    # -- internals -------------------------------------------------------------------

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

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert every invariant of the pool (tests call it after every operation)."""
        parked = [s.slot for s in self.snapshots.values() if s.slot >= 0]
        assert not parked or self.parks_slots, "a parked slot in a pool that copies"
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
        assert not self.snapshots or self.supports_snapshots, "snapshot in a pool without layers"
        copying = self._rings and not self.parks_slots
        expected = set(self.snapshots) if copying else set()
        assert set(self._snapshot_rings) == expected, "snapshot row copies drifted"
        for sid, copies in self._snapshot_rings.items():  # each ring copied whole
            for (group, _), (data, _) in zip(self._row_storages(), copies, strict=True):
                assert isinstance(group, RingGroup), f"snapshot {sid} copies a flat row"
                assert data.shape[0] == group.row, f"snapshot {sid} copies {data.shape[0]} rows"
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
