"""Stateless building blocks of the Llama-family forward: the linear seam, RMSNorm, RoPE."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from slotserve.info import ROPE_CHUNK, ModelInfo, RopeConfig


class Linear(Protocol):
    """The one seam every projection goes through, so quantised kernels can replace it."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        ...


# torch's CPU linear multiplies 2 or 3 rows one row at a time (each row costs as much as a
# lone one), while 4 rows take the blocked GEMM path (cheaper than 2 rows one by one): a
# batch of 2 or 3 is padded to 4. See docs/BENCHMARKS.md (concurrency).
SMALL_BATCH_PAD = 4


@dataclass(frozen=True)
class DenseLinear:
    """``y = x @ weight.T + bias`` with dense weights (fp32, fp16 or bf16)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if 1 < rows < SMALL_BATCH_PAD:
            padded = torch.cat([x, x.new_zeros(SMALL_BATCH_PAD - rows, x.shape[1])])
            return F.linear(padded, self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        extra = self.bias.nbytes if self.bias is not None else 0
        return self.weight.nbytes + extra

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.weight.shape
        return rows, cols


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended
    # smoothly (Llama 3.1's published rule).
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RopeTables:
    """cos/sin rows (rotate-half layout) of positions up to ``max_positions``, computed in
    chunks of `CHUNK` positions as steps first reach them (or `cover` builds them): tables
    for the longest context a model takes would cost memory in proportion to it (positions
    x head width x 2 x 4 bytes, `ModelInfo.rope_table_bytes`), where a device serves a few
    thousand. A chunk is always computed as one tensor, so a position's rows are the same
    bits whichever step first needed them."""

    CHUNK = ROPE_CHUNK

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.inv_freq = rope_inv_freq(rope, head_dim)
        self.max_positions = max_positions
        self._chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def build(cls, rope: RopeConfig, head_dim: int, max_positions: int) -> RopeTables:
        return cls(rope, head_dim, max_positions)

    def _chunk(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._chunks:
            first = index * self.CHUNK
            positions = torch.arange(first, first + self.CHUNK, dtype=torch.float32)
            angles = torch.outer(positions, self.inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._chunks[index] = (angles.cos().contiguous(), angles.sin().contiguous())
        return self._chunks[index]

    def cover(self, positions: int) -> None:
        """Build the rows of positions ``0 .. positions - 1`` now (within ``max_positions``),
        so that no later step's memory includes them."""
        for index in range(-(-min(positions, self.max_positions) // self.CHUNK)):
            self._chunk(index)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin[T, head_dim]`` of ``positions[T]``, gathered from the chunks they fall
        in (nothing the size of the chunks between them is made)."""
        if positions.numel() == 0:
            empty = self.inv_freq.new_zeros(0, 2 * self.inv_freq.shape[0])
            return empty, empty
        last = int(positions.max())
        if last >= self.max_positions or int(positions.min()) < 0:
            raise ValueError(f"position {last} is outside 0 .. {self.max_positions - 1}")
        chunk_of = positions // self.CHUNK
        low, high = int(chunk_of.min()), last // self.CHUNK
        if low == high:
            cos, sin = self._chunk(low)
            local = positions - low * self.CHUNK
            return cos[local], sin[local]
        width = 2 * self.inv_freq.shape[0]
        cos = self.inv_freq.new_empty(positions.numel(), width)
        sin = self.inv_freq.new_empty(positions.numel(), width)
        for index in torch.unique(chunk_of).tolist():
            at = (chunk_of == index).nonzero().squeeze(1)
            chunk_cos, chunk_sin = self._chunk(index)
            local = positions[at] - index * self.CHUNK
            cos[at], sin[at] = chunk_cos[local], chunk_sin[local]
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[T, heads, head_dim]`` by the angles of ``positions[T]``."""
        return rotate(x, *self.rows(positions))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[T, heads, head_dim]`` by rows ``cos, sin[T, head_dim]`` (rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1).to(x.dtype) + rotated * sin.unsqueeze(1).to(x.dtype)


def fused_rope_rows(
    info: ModelInfo, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` rows ``[T, hd]`` (rotate-half layout) laid over the fused Q/K/V row:
    repeated for every query and key head, with the sign of rotate-half folded into ``sin``,
    and 1/0 over the value heads (which RoPE leaves alone)."""
    rotated = info.n_heads + info.n_kv_heads
    half = info.head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=1)
    values = info.n_kv_heads * info.head_dim
    ones = cos.new_ones(cos.shape[0], values)
    return (
        torch.cat([cos.repeat(1, rotated), ones], dim=1),
        torch.cat([signed_sin.repeat(1, rotated), torch.zeros_like(ones)], dim=1),
    )
