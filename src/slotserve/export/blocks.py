"""The 4-bit blocks of a loaded model's `BlockLinear` as ``(q, d, m)``, for a program that
stores them as they are instead of requantising their fp32 dequantisation.

A block holds 32 weights of one row: ``w = d·q + m`` with ``q`` in 0..15 and ``d``, ``m`` the
file's fp16 values (a Q4_0 file's blocks were converted to Q4_1 exactly at load, with
``m = -8·d``). They are read from the model's rows in the file's block layout
(`slotserve.model.gguf_linear.file_rows`: ``d``, ``m``, then 16 bytes of nibbles a block), so
the rows are the model's: Q/K rows already un-permuted, projections fused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.model.gguf_linear import BLOCK, BLOCK_BYTES, BlockLinear, file_rows


@dataclass(frozen=True)
class Q4Blocks:
    """``q[rows, cols]`` (uint8, 0..15), ``d`` and ``m`` ``[rows, cols / 32]`` (fp32):
    weight ``[r, c] = d[r, c // 32] * q[r, c] + m[r, c // 32]``, exactly."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.d.repeat_interleave(BLOCK, 1) * self.q.float() + self.m.repeat_interleave(
            BLOCK, 1
        )

    def rows(self, index: slice) -> Q4Blocks:
        """The blocks of rows ``index`` (one half of a fused projection)."""
        return Q4Blocks(self.q[index], self.d[index], self.m[index])


def q4_blocks(linear: BlockLinear) -> Q4Blocks:
    """The blocks of a Q4_1 `BlockLinear` (a ValueError for another kind)."""
    if linear.kind != "Q4_1":
        raise ValueError(f"a {linear.kind} BlockLinear has no 4-bit blocks")
    rows, cols = linear.shape
    blocks = file_rows(linear.packed, "Q4_1").reshape(rows, cols // BLOCK, BLOCK_BYTES["Q4_1"])
    # Low nibbles hold a block's first 16 weights, high nibbles its last 16.
    nibbles = blocks[:, :, 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).reshape(rows, cols)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float().reshape(rows, -1)
    return Q4Blocks(q, d, m)
