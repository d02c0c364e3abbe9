"""`KVConfig`: the shape of one engine's KV pool, validated up front."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("flat", "ring", "cell")
KV_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
# fp16, as llama.cpp's default: half fp32's bytes, and teacher-forced agreement with
# llama.cpp's greedy tokens holds on every family in tests/data (tests/artifact/parity.py).
DEFAULT_KV_DTYPE = "fp16"


@dataclass(frozen=True)
class KVConfig:
    """How the pool lays out K/V.

    ``layout`` applies to full-attention layers; layers with a model sliding window always
    get a ring of their window (exact, and bounded). With ``layout="ring"`` full-attention
    layers keep ``ring_window`` recent positions plus ``sinks`` first positions forever
    (StreamingLLM-style, an approximation of full attention). ``num_blocks`` (cell only)
    defaults to enough blocks for every session at ``max_context``. Whether decode-sized
    steps attend with the compiled kernel is the pool's ``attention`` argument.
    ``dtype`` is the storage element (`KV_DTYPES`): fp16 by default, bf16, fp32 (twice
    fp16's bytes), or int8 (one fp32 scale per cell and head). Each is a different model,
    exact on its own (docs/ARCHITECTURE.md, "Exactness").
    """

    layout: str = "flat"
    max_seqs: int = 1
    max_context: int = 2048
    block_size: int = 16
    dtype: str = DEFAULT_KV_DTYPE
    ring_window: int = 1024
    sinks: int = 0
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"kv_layout={self.layout!r} is not one of {LAYOUTS}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype={self.dtype!r} is not one of {tuple(KV_DTYPES)}")
        for name in ("max_seqs", "max_context", "block_size", "ring_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sinks < 0:
            raise ValueError(f"sinks={self.sinks} must be >= 0")
        if self.layout == "cell" and self.max_context % self.block_size:
            raise ValueError(
                f"block_size={self.block_size} does not divide max_context={self.max_context}; "
                f"use a max_context that is a multiple of it (e.g. "
                f"{(self.max_context // self.block_size + 1) * self.block_size})"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def blocks_per_seq(self) -> int:
        return self.max_context // self.block_size

    @property
    def total_blocks(self) -> int:
        return (
            self.num_blocks if self.num_blocks is not None else self.max_seqs * self.blocks_per_seq
        )
