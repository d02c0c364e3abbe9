"""`KVStorage`: one layer's K or V cells, ``[n_cells, kv_heads, head_dim]``.

Layouts only compute cell indices; storage writes and gathers by index. fp32/fp16/bf16 keep
values as they are; int8 keeps one fp32 scale per (cell, head) row, symmetric.
"""

from __future__ import annotations

import math
import mmap

import torch

from slotserve.memory import written_bytes

# Below this a tensor is torch's own: a mapping of its own costs a system call and a map entry.
MAPPED_FROM_BYTES = 64 << 10


def zeros_on_write(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero tensor whose pages become resident only when written: a large one lives in an
    anonymous mapping of its own, which the kernel backs with its shared zero page until a
    page is written (reading an unwritten cell gives 0, as `torch.zeros` would, and costs
    nothing). A pool planned for ``max_seqs`` sessions at ``max_context`` then holds only
    what its sessions wrote; the plan still reserves all of it. The tensor keeps its
    mapping alive, and the mapping is unmapped with the last tensor that uses it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MAPPED_FROM_BYTES:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def resident_bytes(tensor: torch.Tensor) -> int:
    """The bytes of a contiguous ``tensor`` the process holds: for a `zeros_on_write` one,
    those on pages written so far; all of a small one, or where Linux cannot tell."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < MAPPED_FROM_BYTES:
        return nbytes
    held = written_bytes(tensor.data_ptr(), nbytes)
    return nbytes if held is None else held


class KVStorage:
    def __init__(self, n_cells: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.quantised = dtype == torch.int8
        self.data = zeros_on_write(n_cells, kv_heads, head_dim, dtype=dtype)
        self.scales = zeros_on_write(n_cells, kv_heads, 1) if self.quantised else None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    @property
    def resident_bytes(self) -> int:
        """What of `nbytes` the process holds: the pages cells were written to."""
        scales = resident_bytes(self.scales) if self.scales is not None else 0
        return resident_bytes(self.data) + scales

    def write(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values[T, heads, dim]`` at cells ``index[T]`` (indices must be unique)."""
        if self.scales is None:
            self.data.index_copy_(0, index, values.to(self.data.dtype))
            return
        scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        quantised = torch.round(values / scale).clamp_(-127, 127).to(torch.int8)
        self.data.index_copy_(0, index, quantised)
        self.scales.index_copy_(0, index, scale.float())

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 values of cells ``index`` (any shape) → ``[*index.shape, heads, dim]``."""
        if self.scales is None:
            return self.data[index].float()
        return self.data[index].float() * self.scales[index]

    def cells(self, start: int, count: int) -> torch.Tensor:
        """A contiguous run of cells, as a view when no dequantisation is needed."""
        if self.scales is None:
            return self.data.narrow(0, start, count).float()
        return self.gather(torch.arange(start, start + count))

    def copy_from(self, other: KVStorage, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Cells ``src`` of ``other`` (the same dtype) into cells ``dst``, bit for bit."""
        self.data.index_copy_(0, dst, other.data[src])
        if self.scales is not None and other.scales is not None:
            self.scales.index_copy_(0, dst, other.scales[src])

    def copy_run(self, src: int, dst: int, count: int) -> None:
        """Cells ``src..src+count`` into ``dst..dst+count`` (runs that do not overlap), bit
        for bit: two slice copies, no index tensors (a copy-on-write block's cells)."""
        self.data.narrow(0, dst, count).copy_(self.data.narrow(0, src, count))
        if self.scales is not None:
            self.scales.narrow(0, dst, count).copy_(self.scales.narrow(0, src, count))

    def copy_cells(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data.index_copy_(0, dst, self.data[src])
        if self.scales is not None:
            self.scales.index_copy_(0, dst, self.scales[src])
