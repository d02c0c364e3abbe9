"""Linears and embeddings on a GGUF file's own weight blocks (Q4_1, Q8_0, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K): the file's bytes, rows interleaved in groups of 8 for the kernel (`pack`; the
layout is in ``native/csrc/quants.h``).

Reading the weights is most of a CPU decode step; these read the file's 4.5 to 8.5 bits
per weight instead of a 32-bit copy, and multiply the way llama.cpp does (activations in
int8 blocks with their own scale, integer dot products per block), so the results follow
llama.cpp's. The products run on OpenMP threads, one per core. Where the kernel cannot be
built (no C compiler), `slotserve.load` keeps dequantised weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import gguf
import numpy as np
import torch

from slotserve.native import require_block_kernel
from slotserve.native.blocks import (
    BLOCK,
    BLOCK_BYTES,
    BLOCK_SIZES,
    FIFTH_BITS,
    GROUP,
    SEGMENTS,
    row_bytes,
)

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "BlockEmbedding",
    "BlockLinear",
    "StackedBlocks",
    "file_rows",
    "pack",
    "to_q4_1",
]


def _interleave(blocks: np.ndarray, kind: str) -> np.ndarray:
    """File blocks ``[G, t, nb, bytes]`` (G groups of t rows) as ``[G, nb · t · bytes]``:
    each group's blocks in turn, each block's segments interleaved over the group's rows."""
    groups, t, nb, _ = blocks.shape
    by_block = blocks.transpose(0, 2, 1, 3)  # [G, nb, t, bytes]
    parts = []
    for start, end, word in SEGMENTS[kind]:
        field = by_block[..., start:end]
        if word == FIFTH_BITS:
            bits = np.unpackbits(field, axis=-1, bitorder="little")
            bits = bits.reshape(groups, nb, t, 2, 4, 4).transpose(0, 1, 4, 3, 2, 5)
            parts.append(np.packbits(bits.reshape(groups, nb, 32 * t), axis=-1, bitorder="little"))
        else:
            words = field.reshape(groups, nb, t, (end - start) // word, word)
            parts.append(words.transpose(0, 1, 3, 2, 4).reshape(groups, nb, t * (end - start)))
    return np.concatenate(parts, axis=-1).reshape(groups, nb * t * BLOCK_BYTES[kind])


def _deinterleave(groups: np.ndarray, kind: str, t: int, nb: int) -> np.ndarray:
    """`_interleave` undone: ``[G, nb · t · bytes]`` as file blocks ``[G, t, nb, bytes]``."""
    count = groups.shape[0]
    by_block = groups.reshape(count, nb, t * BLOCK_BYTES[kind])
    out = np.empty((count, nb, t, BLOCK_BYTES[kind]), dtype=np.uint8)
    at = 0
    for start, end, word in SEGMENTS[kind]:
        width = end - start
        field = by_block[..., at : at + width * t]
        if word == FIFTH_BITS:
            bits = np.unpackbits(field, axis=-1, bitorder="little")
            bits = bits.reshape(count, nb, 4, 2, t, 4).transpose(0, 1, 4, 3, 2, 5)
            out[..., start:end] = np.packbits(
                bits.reshape(count, nb, t, 8 * width), axis=-1, bitorder="little"
            )
        else:
            words = field.reshape(count, nb, width // word, t, word)
            out[..., start:end] = words.transpose(0, 1, 3, 2, 4).reshape(count, nb, t, width)
        at += width * t
    return out.transpose(0, 2, 1, 3)


def pack(gguf_rows: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF matrix's rows (``[rows, in / block values · block bytes]`` uint8) in the
    kernel's layout, the same shape (see ``csrc/quants.h``): rows interleaved in groups of 8
    (the last group the rows left over). Row i of the result is not row i's bytes:
    `file_rows` gives those back."""
    rows = gguf_rows.shape[0]
    blocks = gguf_rows.numpy().reshape(rows, -1, BLOCK_BYTES[kind])
    whole = rows // GROUP * GROUP
    parts = [_interleave(blocks[:whole].reshape(-1, GROUP, *blocks.shape[1:]), kind).reshape(-1)]
    if whole < rows:
        parts.append(_interleave(blocks[None, whole:], kind).reshape(-1))
    return torch.from_numpy(np.concatenate(parts)).reshape(rows, -1)


def file_rows(packed: torch.Tensor, kind: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The file's bytes of a matrix's rows (all, or ``rows`` in that order) from the
    kernel's layout: `pack` undone."""
    count, width = packed.shape
    nb, whole = width // BLOCK_BYTES[kind], count // GROUP * GROUP
    flat = packed.numpy().reshape(-1)
    wanted = np.arange(count) if rows is None else rows.numpy().astype(np.int64)
    groups = np.unique(wanted // GROUP)  # in order: the last group, if partial, comes last
    full = groups[groups * GROUP < whole]
    grouped = flat[: whole * width].reshape(-1, GROUP * width)
    file = _deinterleave(grouped[full], kind, GROUP, nb).reshape(-1, width)
    if len(full) < len(groups):  # the last group, of the rows left over
        tail = _deinterleave(flat[whole * width :][None], kind, count - whole, nb)
        file = np.concatenate([file, tail.reshape(-1, width)])
    picked = file[np.searchsorted(groups, wanted // GROUP) * GROUP + wanted % GROUP]
    return torch.from_numpy(np.ascontiguousarray(picked))


def _dequantize(gguf_rows: torch.Tensor, kind: str) -> torch.Tensor:
    """File rows as fp32, as gguf-py computes them (Q8_0 and Q4_1 here, in its arithmetic:
    an embedding's lookup each step would otherwise spend most of its time in the call)."""
    data = gguf_rows.numpy()
    if kind in ("Q8_0", "Q4_1"):
        blocks = data.reshape(data.shape[0], -1, BLOCK_BYTES[kind])
        d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)
        if kind == "Q8_0":
            weights = d * blocks[:, :, 2:].copy().view(np.int8).astype(np.float32)
        else:
            m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)
            nibbles = blocks[:, :, 4:]
            q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).astype(np.float32)
            weights = d * q + m
        return torch.from_numpy(weights.reshape(data.shape[0], -1))
    weights = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))


@dataclass(frozen=True)
class BlockLinear:
    """``y = x @ W.T`` for ``W[out_features, in_features]`` held in a GGUF file's blocks of
    one type, in the kernel's layout (`pack`; `from_gguf` takes the file's rows, and
    `to_q4_1` turns Q4_0 rows into Q4_1 ones, exactly)."""

    packed: torch.Tensor
    kind: str
    in_features: int
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"kind={self.kind!r} is not one of {tuple(BLOCK_BYTES)}")
        values = BLOCK_SIZES[self.kind][0]
        if self.in_features <= 0 or self.in_features % values:
            raise ValueError(
                f"in_features={self.in_features} must be a positive multiple of {values} "
                f"for {self.kind}"
            )
        width = row_bytes(self.kind, self.in_features)
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(f"packed rows must be 2-D uint8, got {self.packed.dtype}")
        if self.packed.shape[1] != width:
            raise ValueError(
                f"packed {self.kind} rows of {self.in_features} weights are {width} bytes, "
                f"got {self.packed.shape[1]}"
            )

    @classmethod
    def from_gguf(cls, gguf_rows: torch.Tensor, kind: str) -> BlockLinear:
        """From a GGUF matrix's rows, ``[out_features, in_features / 32 · block bytes]``."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"kind={kind!r} is not one of {tuple(BLOCK_BYTES)}")
        if gguf_rows.shape[1] % BLOCK_BYTES[kind]:
            raise ValueError(
                f"{kind} rows are whole {BLOCK_BYTES[kind]}-byte blocks, got "
                f"{gguf_rows.shape[1]} bytes"
            )
        in_features = gguf_rows.shape[1] // BLOCK_BYTES[kind] * BLOCK_SIZES[kind][0]
        return cls(pack(gguf_rows, kind), kind, in_features)

    def rows(self, order: torch.Tensor) -> BlockLinear:
        """The same matrix with its rows in ``order``."""
        moved = pack(file_rows(self.packed, self.kind, order), self.kind)
        return BlockLinear(moved, self.kind, self.in_features, self.bias)

    @classmethod
    def stack(cls, parts: list[BlockLinear], bias: torch.Tensor | None = None) -> BlockLinear:
        """The rows of ``parts`` (one type, one width) one after another. One part is used as
        it is (a tied head shares the embedding's storage); parts whose rows are whole groups
        join as they are, others are interleaved again."""
        first = parts[0]
        if len(parts) == 1:
            return cls(first.packed, first.kind, first.in_features, bias)
        if all(part.shape[0] % GROUP == 0 for part in parts[:-1]):
            joined = torch.cat([part.packed for part in parts])
        else:
            rows = torch.cat([file_rows(part.packed, part.kind) for part in parts])
            joined = pack(rows, first.kind)
        return cls(joined, first.kind, first.in_features, bias)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features = self.shape
        flat = x.reshape(-1, in_features)
        y = require_block_kernel().linear(flat, self.kind, self.packed, in_features)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], out_features)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weights (of ``rows`` only, if given): ``[len(rows), in_features]``."""
        if rows is not None and self._row_offsets is not None:  # an embedding's lookup
            count, width = self.packed.shape
            whole, full, tail = count // GROUP * GROUP, *self._row_offsets
            group, lane = rows.numpy() // GROUP * GROUP, rows.numpy() % GROUP
            offsets = group[:, None] * width + full[lane]
            last = group >= whole  # rows of the last group, which has fewer
            offsets[last] = whole * width + tail[lane[last]]
            flat = self.packed.numpy().reshape(-1)
            return _dequantize(torch.from_numpy(flat[offsets]), self.kind)
        return _dequantize(file_rows(self.packed, self.kind, rows), self.kind)

    @cached_property
    def _row_offsets(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Where each byte of a row's file blocks lies in its group (``[GROUP, width]`` for
        a whole group, ``[n % GROUP, width]`` for a last group of fewer rows), for the byte
        types (Q4_1, Q8_0); None for the others (a Q5 type's fifth bits are bits apart).
        Lookups read through it, one gather of the wanted rows' bytes, rather than through
        `file_rows`, which de-interleaves each wanted row's whole group."""
        if self.kind not in ("Q4_1", "Q8_0"):
            return None
        count, width = self.packed.shape
        blocks = width // BLOCK_BYTES[self.kind]

        def offsets(t: int) -> np.ndarray:
            file_order = np.arange(t * width, dtype=np.int64).reshape(1, t, blocks, -1)
            return np.argsort(_interleave(file_order, self.kind).reshape(-1)).reshape(t, width)

        return offsets(GROUP), offsets(count % GROUP or GROUP)


@dataclass(frozen=True)
class StackedBlocks:
    """The rows of several `BlockLinear` of different types one after another, as one
    projection (llama.cpp's Q4_K_M files mix types inside a layer: a fused Q/K/V whose V
    rows are Q8_0 and Q/K rows Q5_0). The fused kernel halves run it as one chain of
    matrices; called directly, each part multiplies in turn."""

    parts: tuple[BlockLinear, ...]
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a stack needs at least two parts, got {len(self.parts)}")
        widths = {part.in_features for part in self.parts}
        if len(widths) != 1 or any(part.bias is not None for part in self.parts):
            raise ValueError(f"stacked parts share one input width and no biases, got {widths}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y + self.bias if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        bias = self.bias.nbytes if self.bias is not None else 0
        return sum(part.nbytes for part in self.parts) + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


@dataclass(frozen=True)
class BlockEmbedding:
    """The token embedding on the same blocks (a tied head shares them): indexing with
    token ids gives their fp32 rows, as indexing a dense table does."""

    table: BlockLinear

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize(tokens.reshape(-1)).reshape(*tokens.shape, -1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.table.shape

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


def to_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows (``[rows, n · 18]``: fp16 d, 16 bytes of nibbles; ``w = d · (u - 8)``) as
    the same weights in Q4_1 rows (``m = -8 · d``, exact in fp16)."""
    grouped = blocks.reshape(blocks.shape[0], -1, 18)
    scale = grouped[:, :, 0:2].contiguous().view(torch.float16)
    offset = (scale * -8).view(torch.uint8)
    return torch.cat([grouped[:, :, 0:2], offset, grouped[:, :, 2:]], dim=2).reshape(
        blocks.shape[0], -1
    )
