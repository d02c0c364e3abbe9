"""The raw 4-bit blocks of a GGUF tensor (Q4_0, Q4_1), for kernels that can use them as they
are instead of their fp32 dequantisation.

A block holds 32 weights of one row: ``w = d·q + m`` with ``q`` in 0..15 (Q4_1 stores ``d``
and ``m`` as fp16; Q4_0 stores ``d`` and has ``m = -8·d``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader

from slotserve.errors import ArtifactError

BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


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

    def permute_rows(self, order: torch.Tensor) -> Q4Blocks:
        return Q4Blocks(self.q[order], self.d[order], self.m[order])

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Blocks of the row-wise concatenation (a fused projection)."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


def q4_blocks(reader: GGUFReader, name: str, source: str) -> Q4Blocks:
    """The blocks of tensor ``name``; an `ArtifactError` if it is not Q4_0 or Q4_1."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise ArtifactError(source, "tensor missing", name)
    kind = tensor.tensor_type.name
    if kind not in _BLOCK_BYTES:
        raise ArtifactError(source, f"tensor is {kind}, not Q4_0 or Q4_1", name)
    cols, rows = (int(n) for n in tensor.shape)
    blocks = np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(-1, _BLOCK_BYTES[kind])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if kind == "Q4_1":
        m, packed = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0], blocks[:, 4:]
    else:
        m, packed = -8.0 * d, blocks[:, 2:]
    # Low nibbles hold the block's first 16 weights, high nibbles the last 16.
    q = np.concatenate([packed & 0xF, packed >> 4], axis=1)
    return Q4Blocks(
        torch.from_numpy(q.reshape(rows, cols).copy()),
        torch.from_numpy(d.reshape(rows, cols // BLOCK).copy()),
        torch.from_numpy(m.reshape(rows, cols // BLOCK).copy()),
    )
