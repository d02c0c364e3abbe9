"""`SnapshotPool`: read-only snapshots of KV, the second job of `slotserve.kv.pool.KVPool`.

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

It changes sessions, slots and blocks only through what `SessionPool` keeps (its tables
and its copy-on-write accounting); it never steps.
"""

from __future__ import annotations

import torch

from slotserve.errors import KVExhausted, SessionError
from slotserve.info import ModelInfo
from slotserve.kv.config import KVConfig
from slotserve.kv.layouts import CellGroup, FlatGroup, RingGroup
from slotserve.kv.pool_sessions import SessionPool
from slotserve.kv.session import SessionKV
from slotserve.native.attention import AttentionKernel


class SnapshotPool(SessionPool):
    """`SessionPool` with read-only snapshots (see the module doc)."""

    def __init__(
        self, info: ModelInfo, config: KVConfig, attention: AttentionKernel | None = None
    ) -> None:
        super().__init__(info, config, attention)
        # Each snapshot's copy of its session's ring rows, whole (a pool with flat rows
        # parks instead); one (data, int8 scales) pair per storage, in `_row_storages` order.
        self._snapshot_rings: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}

    # -- sizes -------------------------------------------------------------------------

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

    @property
    def block_nbytes(self) -> int:
        """Bytes of one cell block across every layer (K and V)."""
        return sum(g.nbytes for g in self._cells) // max(self.config.total_blocks, 1)

    # -- snapshots ---------------------------------------------------------------------

    def snapshot_ids(self) -> set[int]:
        return set(self.snapshots)

    def snapshot_blocks(self, snapshot: int) -> list[int]:
        """The blocks ``snapshot`` holds (a copy of its table)."""
        return list(self._get_snapshot(snapshot).table)

    def retains(self, snapshot: int, upto: int) -> bool:
        """Whether every layer of ``snapshot`` still holds what a session restored from its
        first ``upto`` positions needs: cell layers keep every position; a sliding-window
        ring written up to the snapshot's end keeps only its last window, which serves
        ``upto`` only near that end (or if it never wrapped)."""
        frozen = self._get_snapshot(snapshot)
        return all(ring.can_truncate(frozen.high_water, upto) for ring in self._rings)

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

    # -- internals ---------------------------------------------------------------------

    def _get_snapshot(self, snapshot: int) -> SessionKV:
        if snapshot not in self.snapshots:
            raise SessionError(f"unknown snapshot {snapshot} (never published, or dropped)")
        return self.snapshots[snapshot]

    def _check_snapshots_supported(self) -> None:
        if not self.supports_snapshots:
            raise SessionError("snapshots need a pool with layers")

    def _copied_cells(self, group: RingGroup | FlatGroup, slot: int, length: int) -> torch.Tensor:
        """The cells of ``slot`` a snapshot of ``length`` positions copies in ``group``."""
        if isinstance(group, RingGroup):  # the whole ring: which cells are live is its state
            return torch.arange(slot * group.row, (slot + 1) * group.row)
        return torch.arange(slot * group.max_context, slot * group.max_context + length)

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

    # -- checks ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """`SessionPool.check_integrity`, and the snapshots' own invariants: parked slots
        only where the pool parks, ring copies exactly for the snapshots that need them."""
        super().check_integrity()
        parked = [s.slot for s in self.snapshots.values() if s.slot >= 0]
        assert not parked or self.parks_slots, "a parked slot in a pool that copies"
        assert not self.snapshots or self.supports_snapshots, "snapshot in a pool without layers"
        copying = self._rings and not self.parks_slots
        expected = set(self.snapshots) if copying else set()
        assert set(self._snapshot_rings) == expected, "snapshot row copies drifted"
        for sid, copies in self._snapshot_rings.items():  # each ring copied whole
            for (group, _), (data, _) in zip(self._row_storages(), copies, strict=True):
                assert isinstance(group, RingGroup), f"snapshot {sid} copies a flat row"
                assert data.shape[0] == group.row, f"snapshot {sid} copies {data.shape[0]} rows"
