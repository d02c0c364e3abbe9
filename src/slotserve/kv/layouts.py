"""The three KV layouts, as groups of layers sharing one way of placing positions in cells.

A group maps (session, position) to a cell of its storage and answers, for a step, which
cells to write and which keys each query sees. The pool owns the sessions and the block
allocator; groups own only their layers' storage and the arithmetic.

- `FlatGroup`: session slot ``s`` owns cells ``s*C .. s*C + C - 1``.
- `CellGroup`: position ``p`` lives in block ``table[p // bs]`` at offset ``p % bs``.
- `RingGroup`: slot ``s`` owns ``sinks + window`` cells; sink positions stay, the rest
  wrap, so the footprint is bounded whatever the length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from slotserve.kv.attention import attend, pad_rows, prefix_mask, visibility_mask
from slotserve.kv.batch import StepBatch
from slotserve.kv.plan import GroupPlan, PrefixPlan, RingKernelPlan, RingPlan
from slotserve.kv.session import SessionKV
from slotserve.kv.storage import KVStorage
from slotserve.native.attention import AttentionKernel, LayerAttends, StepCells, Storage


@dataclass(frozen=True)
class GroupShape:
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


class LayerGroup(ABC):
    """Storage and placement rule for a set of layers."""

    kind: str

    def __init__(self, layers: list[int], n_cells: int, shape: GroupShape) -> None:
        self.layers = layers
        self.shape = shape
        self.n_cells = n_cells
        self.keys = {layer: self._storage(shape) for layer in layers}
        self.values = {layer: self._storage(shape) for layer in layers}

    def _storage(self, shape: GroupShape) -> KVStorage:
        return KVStorage(self.n_cells, shape.kv_heads, shape.head_dim, shape.dtype)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.keys.values()) + sum(
            s.nbytes for s in self.values.values()
        )

    @property
    def resident_bytes(self) -> int:
        """What of `nbytes` is resident: the pages its sessions wrote (`zeros_on_write`)."""
        storages = (*self.keys.values(), *self.values.values())
        return sum(s.resident_bytes for s in storages)

    @abstractmethod
    def cell_index(self, session: SessionKV, positions: torch.Tensor) -> torch.Tensor:
        """Cells holding ``positions`` of ``session``."""

    @abstractmethod
    def plan(self, batch: StepBatch, sessions: Mapping[int, SessionKV], heads: int) -> GroupPlan:
        """The step's cells in this group (`slotserve.kv.plan`), for queries of ``heads``
        heads: made once a step, after its blocks are un-shared, and read by every layer."""

    @abstractmethod
    def update_and_attend(
        self, layer: int, qkv: torch.Tensor, batch: StepBatch, plan: GroupPlan
    ) -> torch.Tensor:
        """Write the step's K/V for ``layer`` (from fused ``[q | k | v]`` rows) at the cells
        ``plan`` (this group's, made by `plan`) names and return its attention output."""

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``q[T, heads, hd]``, ``k, v[T, kv_heads, hd]`` of fused rows."""
        kv_heads, head_dim = self.shape.kv_heads, self.shape.head_dim
        heads = self.query_heads(qkv)
        q, k, v = torch.split(qkv.view(qkv.shape[0], -1, head_dim), [heads, kv_heads, kv_heads], 1)
        return q, k, v

    def query_heads(self, qkv: torch.Tensor) -> int:
        """How many query heads fused ``[q | k | v]`` rows carry."""
        return qkv.shape[1] // self.shape.head_dim - 2 * self.shape.kv_heads

    def visible_positions(self, length: int) -> torch.Tensor:
        """Stored positions that the next query of a session of ``length`` can see."""
        return torch.arange(length)

    def copy_positions(self, src: SessionKV, dst: SessionKV, upto: int) -> None:
        """Copy positions below ``upto`` of ``src`` into ``dst``, every layer."""
        positions = torch.arange(upto)
        self._copy_cells(self.cell_index(src, positions), self.cell_index(dst, positions))

    def _copy_cells(self, src_cells: torch.Tensor, dst_cells: torch.Tensor) -> None:
        for storage in (*self.keys.values(), *self.values.values()):
            storage.copy_cells(src_cells, dst_cells)


class PrefixGroup(LayerGroup):
    """Layouts that keep every position (flat, cell): write first, then attend over
    positions ``0..end-1`` of each sequence."""

    def __init__(
        self,
        layers: list[int],
        n_cells: int,
        shape: GroupShape,
        window: int | None,
        kernel: AttentionKernel | None = None,
    ) -> None:
        super().__init__(layers, n_cells, shape)
        self.window = window
        self.kernel = kernel
        # Each layer's kernel arguments, kept from step to step (`set_attends` sets them).
        self.attends = (
            None
            if kernel is None
            else LayerAttends({layer: self._storages(layer) for layer in self.layers})
        )

    def set_attends(
        self, plan: GroupPlan, qkv: torch.Tensor, heads: int, out: torch.Tensor
    ) -> LayerAttends | None:
        """Each layer's kernel arguments for the step ``plan`` is this group's plan of, the
        call `update_and_attend` makes, writing ``out``; None without the kernel."""
        if self.kernel is None or self.attends is None:
            return None
        step = self._kernel_step(plan, heads)
        first = self._storages(self.layers[0])
        args = self.kernel.arguments(qkv, heads, step, *first, self.window, 0, out)
        self.attends.set(args)
        return self.attends

    @staticmethod
    def _kernel_step(plan: GroupPlan, heads: int) -> StepCells:
        """``plan``'s cells for the kernel, checked against the queries' ``heads`` (the
        kernel's scratch is sized for the plan's)."""
        assert isinstance(plan, PrefixPlan) and plan.kernel is not None
        if heads != plan.heads:
            raise ValueError(f"rows of {heads} query heads in a step planned for {plan.heads}")
        return plan.kernel

    def _storages(self, layer: int) -> tuple[Storage, Storage]:
        key, value = self.keys[layer], self.values[layer]
        return (key.data, key.scales), (value.data, value.scales)

    def plan(self, batch: StepBatch, sessions: Mapping[int, SessionKV], heads: int) -> PrefixPlan:
        key_len = max(batch.ends)
        bound = [sessions[s] for s in batch.sessions]
        write = torch.cat(
            [
                self.cell_index(s, torch.arange(a, e))
                for s, a, e in zip(bound, batch.starts, batch.ends, strict=True)
            ]
        )
        # Padding keys (past a sequence's end) point at its last real cell; the mask hides them.
        gather = torch.stack(
            [
                self.cell_index(s, torch.arange(key_len).clamp(max=e - 1))
                for s, e in zip(bound, batch.ends, strict=True)
            ]
        )
        if self.kernel is not None:
            seq, group = batch.pad_index()[0], heads // self.shape.kv_heads
            step = StepCells.of(write, gather, seq, batch.positions, group, self.kernel.threads)
            return PrefixPlan(write, gather, heads, step)
        causal = batch.size == 1 and batch.starts[0] == 0 and self.window is None
        mask = None if causal else prefix_mask(batch, key_len, self.window)
        return PrefixPlan(write, gather, heads, None, causal, mask)

    def _keys(self, storage: KVStorage, gather: torch.Tensor) -> torch.Tensor:
        if self.kind == "flat" and gather.shape[0] == 1:
            return storage.cells(int(gather[0, 0]), gather.shape[1]).unsqueeze(0)
        return storage.gather(gather)

    def update_and_attend(
        self, layer: int, qkv: torch.Tensor, batch: StepBatch, plan: GroupPlan
    ) -> torch.Tensor:
        """The kernel reads the fused rows in place; the torch path takes views of them."""
        assert isinstance(plan, PrefixPlan)
        if plan.kernel is not None:
            assert self.kernel is not None
            heads = self.query_heads(qkv)
            step, storages = self._kernel_step(plan, heads), self._storages(layer)
            return self.kernel.update_and_attend(qkv, heads, step, *storages, self.window)
        q, k, v = self.split(qkv)
        self.keys[layer].write(plan.write, k)
        self.values[layer].write(plan.write, v)
        keys = self._keys(self.keys[layer], plan.gather).transpose(1, 2)
        values = self._keys(self.values[layer], plan.gather).transpose(1, 2)
        return attend(q, keys, values, batch, plan.mask, causal_from_zero=plan.causal)


class FlatGroup(PrefixGroup):
    kind = "flat"

    def __init__(
        self,
        layers: list[int],
        max_seqs: int,
        max_context: int,
        shape: GroupShape,
        window: int | None,
        kernel: AttentionKernel | None = None,
    ) -> None:
        super().__init__(layers, max_seqs * max_context, shape, window, kernel)
        self.max_context = max_context

    def cell_index(self, session: SessionKV, positions: torch.Tensor) -> torch.Tensor:
        return session.slot * self.max_context + positions


class CellGroup(PrefixGroup):
    kind = "cell"

    def __init__(
        self,
        layers: list[int],
        total_blocks: int,
        block_size: int,
        shape: GroupShape,
        window: int | None,
        kernel: AttentionKernel | None = None,
    ) -> None:
        super().__init__(layers, total_blocks * block_size, shape, window, kernel)
        self.block_size = block_size

    def cell_index(self, session: SessionKV, positions: torch.Tensor) -> torch.Tensor:
        # In numpy: a step asks twice a sequence, and on arrays this small torch's per-op
        # dispatch costs more than the indexing itself.
        table, at = np.asarray(session.table, dtype=np.int64), positions.numpy()
        return torch.from_numpy(
            table[at // self.block_size] * self.block_size + at % self.block_size
        )

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one whole block in every layer (copy-on-write)."""
        size = self.block_size
        for storage in (*self.keys.values(), *self.values.values()):
            storage.copy_run(src * size, dst * size, size)


class RingGroup(LayerGroup):
    """Keeps ``sinks`` first positions and the last ``window`` positions of each session.

    A query at position p sees keys at positions ``> p - window`` and every sink. The ring's
    old cells stay intact until the step has attended, so a chunk longer than the free run of
    the ring, or longer than the window itself, is exact; then the new rows the ring keeps
    are written. With the compiled kernel the step's rows are first stored in step buffers of
    the storage's dtype, so every key a query reads has the storage's rounding, old and new
    alike (a row's attention does not depend on how its sequence was chunked), and the kept
    rows are copied from them bit for bit.
    """

    kind = "ring"

    def __init__(
        self,
        layers: list[int],
        max_seqs: int,
        window: int,
        sinks: int,
        shape: GroupShape,
        kernel: AttentionKernel | None = None,
    ) -> None:
        super().__init__(layers, max_seqs * (window + sinks), shape)
        self.window, self.sinks = window, sinks
        self.row = window + sinks
        self.kernel = kernel

    def cell_index(self, session: SessionKV, positions: torch.Tensor) -> torch.Tensor:
        wrapped = self.sinks + (positions - self.sinks).remainder(self.window)
        return session.slot * self.row + torch.where(positions < self.sinks, positions, wrapped)

    def kept_positions(self, length: int) -> torch.Tensor:
        """Positions of a session of ``length`` that its next query can see: the sinks and
        the last ``window - 1`` (the query itself is the window's last position)."""
        sinks = torch.arange(min(self.sinks, length))
        recent = torch.arange(min(length, max(self.sinks, length - self.window + 1)), length)
        return torch.cat([sinks, recent])

    def can_truncate(self, high_water: int, new_length: int) -> bool:
        """Whether every position a query at ``new_length`` may see is still in the ring
        of a session that has written up to ``high_water`` (rewind and clone need it)."""
        needed_from = max(self.sinks, new_length - self.window + 1)
        intact_from = high_water - self.window  # cells below this were overwritten
        return needed_from >= min(intact_from, new_length)

    def plan(
        self, batch: StepBatch, sessions: Mapping[int, SessionKV], heads: int
    ) -> RingPlan | RingKernelPlan:
        """On the kernel, `_kernel_plan`; on torch ops, `_torch_plan`."""
        if self.kernel is not None:
            return self._kernel_plan(batch, sessions, heads)
        return self._torch_plan(batch, sessions)

    def _kernel_plan(
        self, batch: StepBatch, sessions: Mapping[int, SessionKV], heads: int
    ) -> RingKernelPlan:
        """Row t of the step goes to the step buffers (cell ``n_cells + t``); each
        sequence's positions map to the ring's cells below its start, to the step buffers
        from it. The buffers are made once a step and shared by the group's layers."""
        assert self.kernel is not None
        bound = [sessions[s] for s in batch.sessions]
        key_len, offset, split = max(batch.ends), 0, self.n_cells
        tables = []
        for session, start, end in zip(bound, batch.starts, batch.ends, strict=True):
            table = self.cell_index(session, torch.arange(key_len))
            table[start:end] = split + offset + torch.arange(end - start)
            tables.append(table)
            offset += end - start
        shape = self.shape
        keys, values = (
            KVStorage(batch.n_tokens, shape.kv_heads, shape.head_dim, shape.dtype)
            for _ in ("keys", "values")
        )
        step = StepCells.of(
            split + torch.arange(batch.n_tokens), torch.stack(tables), batch.pad_index()[0],
            batch.positions, heads // shape.kv_heads, self.kernel.threads,
            ((keys.data, keys.scales), (values.data, values.scales)), split,
        )  # fmt: skip
        rows, ring_cells = self._new_cells(batch, bound)
        return RingKernelPlan(step, heads, (keys, values), rows, ring_cells)

    def _torch_plan(self, batch: StepBatch, sessions: Mapping[int, SessionKV]) -> RingPlan:
        bound = [sessions[s] for s in batch.sessions]
        old = [self.kept_positions(start) for start in batch.starts]
        old_len = max(len(p) for p in old)
        old_pos = torch.full((batch.size, old_len), -1, dtype=torch.long)
        old_cells = torch.zeros((batch.size, old_len), dtype=torch.long)
        for b, (session, positions) in enumerate(zip(bound, old, strict=True)):
            old_pos[b, : len(positions)] = positions
            if len(positions):
                old_cells[b, : len(positions)] = self.cell_index(session, positions)
        new_pos = batch.query_positions()
        new_valid = new_pos < torch.tensor(batch.ends).view(-1, 1)
        k_pos = torch.cat([old_pos, new_pos], dim=1)
        k_valid = torch.cat([old_pos >= 0, new_valid], dim=1)
        mask = visibility_mask(new_pos, k_pos, k_valid, self.window, self.sinks)
        rows, write = self._new_cells(batch, bound)
        return RingPlan(old_cells, mask, rows, write)

    def _new_cells(
        self, batch: StepBatch, bound: list[SessionKV]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the step's new tokens that stay in the ring (sinks and the last
        ``window`` of each sequence), and their cells: every cell is written once."""
        rows, cells, offset = [], [], 0
        for session, start, end in zip(bound, batch.starts, batch.ends, strict=True):
            positions = torch.arange(start, end)
            keep = (positions < self.sinks) | (positions >= end - self.window)
            rows.append(offset + keep.nonzero().flatten())
            cells.append(self.cell_index(session, positions[keep]))
            offset += end - start
        return torch.cat(rows), torch.cat(cells)

    def visible_positions(self, length: int) -> torch.Tensor:
        return self.kept_positions(length)

    def _as_stored(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``rows[T, kv_heads, head_dim]`` as the storage would give them back."""
        if self.shape.dtype == torch.float32:
            return rows.float()
        buffer = KVStorage(len(rows), self.shape.kv_heads, self.shape.head_dim, self.shape.dtype)
        buffer.write(torch.arange(len(rows)), rows)
        return buffer.cells(0, len(rows))

    def copy_positions(self, src: SessionKV, dst: SessionKV, upto: int) -> None:
        """Copy the whole ring row: the clone's ring then holds what the source's holds
        (the pool checks that what ``upto`` needs is still there)."""
        cells = torch.arange(self.row)
        self._copy_cells(src.slot * self.row + cells, dst.slot * self.row + cells)

    def update_and_attend(
        self, layer: int, qkv: torch.Tensor, batch: StepBatch, plan: GroupPlan
    ) -> torch.Tensor:
        if isinstance(plan, RingKernelPlan):
            assert self.kernel is not None
            heads = self.query_heads(qkv)
            if heads != plan.heads:
                raise ValueError(f"rows of {heads} query heads in a step planned for {plan.heads}")
            key_rows, value_rows = plan.buffers
            key, value = self.keys[layer], self.values[layer]
            storages = (key.data, key.scales), (value.data, value.scales)
            out = self.kernel.update_and_attend(
                qkv, heads, plan.kernel, *storages, self.window, self.sinks
            )
            key.copy_from(key_rows, plan.rows, plan.to)
            value.copy_from(value_rows, plan.rows, plan.to)
            return out
        assert isinstance(plan, RingPlan)
        q, k, v = self.split(qkv)
        # The step's own rows with the storage's rounding, as the kernel path reads them:
        # a row's attention then does not depend on how its sequence was chunked.
        keys = torch.cat(
            [self.keys[layer].gather(plan.old_cells), pad_rows(self._as_stored(k), batch)], 1
        )
        values = torch.cat(
            [self.values[layer].gather(plan.old_cells), pad_rows(self._as_stored(v), batch)], 1
        )
        out = attend(q, keys.transpose(1, 2), values.transpose(1, 2), batch, plan.mask)
        self.keys[layer].write(plan.write, k[plan.rows])
        self.values[layer].write(plan.write, v[plan.rows])
        return out
