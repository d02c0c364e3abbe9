"""What the pool publishes about who holds which of its cells (`KVPool.holdings`): plain
frozen copies of its own tables, for monitoring (the engine's `PoolView`, the dashboard)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slotserve.kv.session import SessionKV


@dataclass(frozen=True)
class RowGroup:
    """Layers that keep each slot's positions in a row: ``flat`` (a whole context) or
    ``ring`` (a window, plus sinks). Slot ``s`` owns cells ``s * size .. (s + 1) * size - 1``
    of each layer in ``layers``."""

    kind: Literal["flat", "ring"]
    layers: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class RowCells:
    """One session's row in one `RowGroup`: cells ``first .. first + group.size - 1``, of
    which ``live`` hold positions it still sees; ``wrapped``: a ring written past its row
    (its oldest positions, after the sinks, were overwritten)."""

    group: RowGroup
    first: int
    live: int
    wrapped: bool


@dataclass(frozen=True)
class Holding:
    """What one session, or one read-only snapshot (``slot`` None), holds in the pool.

    ``blocks`` is its cell block table in position order (block ``blocks[i]`` holds positions
    ``i * block_size ..``; every cell layer uses the same table), ``refcounts[i]`` the number
    of tables holding ``blocks[i]`` (above 1: shared copy-on-write). ``rows``: its row in
    each flat or ring group (a snapshot has none: it keeps copies of its ring rows outside
    the pool's storage). ``length`` positions are written, ``capacity`` reserved."""

    session: int
    slot: int | None
    length: int
    capacity: int
    blocks: tuple[int, ...]
    refcounts: tuple[int, ...]
    rows: tuple[RowCells, ...]


@dataclass(frozen=True)
class PoolHoldings:
    """Who holds which cells of the pool, copied from its own tables (`KVPool.holdings`).
    ``block_size`` is None without cell layers."""

    block_size: int | None
    row_groups: tuple[RowGroup, ...]
    sessions: tuple[Holding, ...]
    snapshots: tuple[Holding, ...]


def row_cells(group: RowGroup, bound: SessionKV) -> RowCells:
    """``bound``'s row in ``group``: a flat row holds every written position; a ring its
    last ``size`` (sinks included), having wrapped once written past them."""
    live = min(bound.length, group.size)
    wrapped = group.kind == "ring" and bound.high_water > group.size
    return RowCells(group, bound.slot * group.size, live, wrapped)
