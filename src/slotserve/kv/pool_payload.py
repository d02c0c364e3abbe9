"""`PayloadPool`: a snapshot's payload for the prefix cache's disk tier, the third job of
`slotserve.kv.pool.KVPool`.

`payload_parts` names its tensors and their shapes, `payload_of` captures a snapshot's
block table and row copies (by whoever drives the pool), `read_payload` copies its cells
out (from another thread too: a snapshot's blocks are never written while it holds them),
and `load_payload` writes one into a freshly reserved session: `write_payload` (from
another thread too, while whoever drives the pool neither steps nor releases that session)
then `commit_payload`. It reads snapshots and writes only a reserved, empty session's own
cells; it never makes or drops a snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from slotserve.errors import SessionError
from slotserve.kv.layouts import FlatGroup, LayerGroup, RingGroup
from slotserve.kv.pool_snapshots import SnapshotPool
from slotserve.kv.session import SessionKV
from slotserve.kv.storage import KVStorage


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


class PayloadPool(SnapshotPool):
    """`SnapshotPool` whose snapshots can be copied out and loaded back (see the module doc)."""

    # -- payloads ----------------------------------------------------------------------

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

    def retains_from(self, high_water: int, upto: int) -> bool:
        """`retains` for a snapshot written up to ``high_water`` that this pool does not
        hold (a stored one): whether every ring still holds what a restore from ``upto``
        needs."""
        return all(ring.can_truncate(high_water, upto) for ring in self._rings)

    # -- internals ---------------------------------------------------------------------

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

    @staticmethod
    def _check_loadable(session: int, bound: SessionKV, upto: int) -> None:
        if bound.length or not 0 < upto <= bound.capacity:
            raise SessionError(
                f"load_payload upto={upto} into session {session} (length {bound.length}, "
                f"capacity {bound.capacity}): it must be empty and hold upto positions"
            )

    def _block_cells(self, table: list[int], length: int) -> torch.Tensor:
        """The cells of positions ``0 .. length - 1`` through block ``table``."""
        positions, bs = torch.arange(length), self.config.block_size
        return torch.tensor(table, dtype=torch.long)[positions // bs] * bs + positions % bs

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
