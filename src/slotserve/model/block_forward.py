"""The Llama forward for GGUF block weights: per layer, one kernel call before the attention
(RMSNorm, the fused Q/K/V product, RoPE) and one after it (the output product and residual,
RMSNorm, gate/up, SwiGLU, down and residual), around the pool's ``update_and_attend_rows``.

It computes what `slotserve.model.llama.forward_hidden` computes on the same weights (the
same `BlockLinear` products, norms and rotations); it only leaves out the dozens of small
torch calls per layer that would otherwise cost as much as the products at decode time.
`BlockLayers.of` returns None for a model it does not cover (dense or int8 projections,
QKV biases, per-head Q/K norms), which keeps the eager forward.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from slotserve.info import ModelInfo
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model.gguf_linear import (
    BLOCK,
    KIND_CODES,
    BlockLinear,
    GGUFKernel,
    gguf_kernel,
    padded_blocks,
)
from slotserve.model.layers import RopeTables, rms_norm
from slotserve.model.weights import LlamaWeights


class Matrix(ctypes.Structure):
    """A projection as the kernel takes it: its packed rows, GGUF type code, row count."""

    _fields_ = [("blocks", ctypes.c_void_p), ("kind", ctypes.c_int64), ("rows", ctypes.c_int64)]

    @classmethod
    def of(cls, linear: BlockLinear) -> Matrix:
        return cls(linear.packed.data_ptr(), KIND_CODES[linear.kind], linear.shape[0])


class Scratch(ctypes.Structure):
    """A step's work space: ``h[m, widest]`` fp32, ``q[m, widest]`` int8, ``d, s``."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("h", "q", "d", "s")]


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix


@dataclass(frozen=True)
class BlockLayers:
    """The layers of one model prepared for the kernel (made once, with the model)."""

    kernel: GGUFKernel
    info: ModelInfo
    layers: tuple[_Layer, ...]

    @classmethod
    def of(cls, weights: LlamaWeights, info: ModelInfo) -> BlockLayers | None:
        kernel = gguf_kernel()
        if kernel is None or info.qk_norm:
            return None
        linears = [(x.qkv, x.o, x.gate_up, x.down) for x in weights.layers]
        if not all(
            isinstance(linear, BlockLinear) and linear.bias is None
            for group in linears
            for linear in group
        ):
            return None
        layers = tuple(
            _Layer(
                layer.attn_norm.float().contiguous(),
                layer.mlp_norm.float().contiguous(),
                *(Matrix.of(linear) for linear in group),  # type: ignore[arg-type]
            )
            for layer, group in zip(weights.layers, linears, strict=True)
        )
        return cls(kernel, info, layers)

    def forward_hidden(
        self,
        weights: LlamaWeights,
        rope: RopeTables,
        tokens: torch.Tensor,
        batch: StepBatch,
        kv: KVStore,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, dim]``, as `forward_hidden` returns them."""
        info = self.info
        x = weights.embed[tokens].float().contiguous()
        m = x.shape[0]
        qkv_width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
        attn_width = info.n_heads * info.head_dim
        widest = max(info.dim, info.ffn_dim, attn_width)
        qkv, gate_up = torch.empty(m, qkv_width), torch.empty(m, 2 * info.ffn_dim)
        blocks = padded_blocks(widest)
        h, q = torch.empty(m, widest), torch.empty(m, blocks * BLOCK, dtype=torch.int8)
        scales = torch.empty(2, m, blocks)
        scratch = Scratch(h.data_ptr(), q.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr())
        positions = batch.positions.to(torch.int64).contiguous()
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        rotated = info.n_heads + info.n_kv_heads
        eps = info.norm_eps
        for index, layer in enumerate(self.layers):
            self.kernel.layer_in(
                x, layer.attn_norm, eps, layer.qkv, qkv, rotated, info.head_dim,
                cos, sin, positions, scratch,
            )  # fmt: skip
            attn = kv.update_and_attend_rows(index, qkv, batch)
            if attn.dtype != torch.float32 or not attn.is_contiguous():
                attn = attn.float().contiguous()
            self.kernel.layer_out(
                x, attn, layer.o, layer.mlp_norm, eps, layer.gate_up, gate_up, layer.down,
                scratch,
            )  # fmt: skip
        return rms_norm(x, weights.norm, eps)
