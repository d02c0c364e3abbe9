"""Linears and embeddings on a GGUF file's own weight blocks (Q4_1, Q8_0, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K): the file's bytes, Q4_1, Q8_0, Q5_0 and Q5_1 packed in pairs of blocks for the
kernel (`slotserve.native.blocks`), the K-quants as the file has them.

Reading the weights is most of a CPU decode step; these read the file's 4.5 to 8.5 bits
per weight instead of a 32-bit copy, and multiply the way llama.cpp does (activations in
int8 blocks with their own scale, integer dot products per block), so the results follow
llama.cpp's. The products run on OpenMP threads, one per core. Where the kernel cannot be
built (no C compiler), `slotserve.load` keeps dequantised weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from slotserve.native import require_block_kernel
from slotserve.native.blocks import (
    BLOCK,
    BLOCK_BYTES,
    BLOCK_SIZES,
    PACKED_KINDS,
    padded_blocks,
    row_bytes,
)

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "BlockEmbedding",
    "BlockLinear",
    "StackedBlocks",
    "pack",
    "to_q4_1",
    "unpack",
]


def pack(gguf_rows: torch.Tensor, kind: str) -> torch.Tensor:
    """A GGUF matrix's rows (``[rows, in / block values · block bytes]`` uint8) in the
    kernel's layout (see ``csrc/quants.h``): Q4_1, Q8_0, Q5_0 and Q5_1 moved into pairs of
    blocks, the K-quants as they are."""
    if kind not in PACKED_KINDS:
        return gguf_rows
    rows = gguf_rows.shape[0]
    grouped = gguf_rows.reshape(rows, -1, BLOCK_BYTES[kind])
    if grouped.shape[1] % 2:  # a zero block pads the row to pairs
        grouped = torch.cat([grouped, grouped.new_zeros(rows, 1, BLOCK_BYTES[kind])], dim=1)
    pairs = grouped.shape[1] // 2
    scale = grouped[:, :, 0:2].reshape(rows, -1)
    if kind == "Q4_1":
        nibbles = grouped[:, :, 4:].reshape(rows, -1)
        return torch.cat([nibbles, scale, grouped[:, :, 2:4].reshape(rows, -1)], dim=1)
    if kind in ("Q5_0", "Q5_1"):
        bits_at = 2 if kind == "Q5_0" else 4
        nibbles = grouped[:, :, bits_at + 4 :].reshape(rows, -1)
        # qh of each block as [block, half, 2 bytes] -> per pair [half, block, 2 bytes]: the
        # word of a half holds the first block's 16 bits, then the second's
        bits = grouped[:, :, bits_at : bits_at + 4].reshape(rows, pairs, 2, 2, 2)
        bits = bits.transpose(2, 3).reshape(rows, -1)
        tail = [scale] if kind == "Q5_0" else [scale, grouped[:, :, 2:4].reshape(rows, -1)]
        return torch.cat([nibbles, bits, *tail], dim=1)
    values = grouped[:, :, 2:].reshape(rows, pairs, 2, 2, 16)  # [pair, block, half, 16]
    values = values.transpose(2, 3).reshape(rows, -1)  # pair order: [pair, half, block, 16]
    return torch.cat([values, scale], dim=1)


def _file_blocks(packed: torch.Tensor, kind: str, blocks: int) -> torch.Tensor:
    """A packed Q5_0 / Q5_1 row's blocks back in the file's layout ``[rows, blocks, bytes]``."""
    rows = packed.shape[0]
    nibbles = packed[:, : blocks * 16].reshape(rows, blocks, 16)
    bits = packed[:, blocks * 16 : blocks * 20].reshape(rows, blocks // 2, 2, 2, 2)
    bits = bits.transpose(2, 3).reshape(rows, blocks, 4)
    scale = packed[:, blocks * 20 : blocks * 22].reshape(rows, blocks, 2)
    head = [scale] if kind == "Q5_0" else [scale, packed[:, blocks * 22 :].reshape(rows, blocks, 2)]
    return torch.cat([*head, bits, nibbles], dim=2)


def unpack(packed: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """The fp32 weights ``[rows, in_features]`` of the kernel's rows (gguf-py dequantises
    the types that keep the file's blocks, and the Q5 types put back in them)."""
    rows, blocks = packed.shape[0], padded_blocks(in_features)
    if kind in ("Q5_0", "Q5_1"):
        packed = _file_blocks(packed, kind, blocks).reshape(rows, -1)
        packed = packed[:, : in_features // BLOCK * BLOCK_BYTES[kind]].contiguous()
    if kind not in ("Q4_1", "Q8_0"):
        quant = gguf.GGMLQuantizationType[kind]
        weights = gguf.quants.dequantize(packed.numpy(), quant)
        return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))
    if kind == "Q4_1":
        nibbles = packed[:, : blocks * 16].reshape(rows, blocks, 16)
        halves = packed[:, blocks * 16 :].contiguous().view(torch.float16).float()
        scale, offset = halves[:, :blocks, None], halves[:, blocks:, None]
        values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).float() * scale + offset
    else:
        ints = packed[:, : blocks * 32].contiguous().view(torch.int8)
        ints = ints.reshape(rows, blocks // 2, 2, 2, 16).transpose(2, 3)  # back to blocks
        scale = packed[:, blocks * 32 :].contiguous().view(torch.float16).float()
        values = ints.reshape(rows, blocks, BLOCK).float() * scale[:, :, None]
    return values.reshape(rows, -1)[:, :in_features]


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
        return BlockLinear(self.packed[order].contiguous(), self.kind, self.in_features, self.bias)

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
        packed = self.packed if rows is None else torch.index_select(self.packed, 0, rows)
        return unpack(packed, self.kind, self.in_features)


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
