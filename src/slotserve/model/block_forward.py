"""The Llama family's fused halves on GGUF block weights: per layer, one kernel call before
the attention (RMSNorm, the fused Q/K/V product, RoPE) and one after it (the output product
and residual, RMSNorm, gate/up, SwiGLU, down and residual).

They compute what `slotserve.model.llama.EagerHalves` computes on the same weights (the
same block products, norms and rotations); they only leave out the dozens of small torch
calls per layer that would otherwise cost as much as the products at decode time.
`BlockHalves.refusal` says why a model is not covered (then it runs the eager halves, on
the same blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.info import ModelInfo
from slotserve.model.gguf_linear import BlockLinear
from slotserve.model.halves import HalvesKind, StepContext
from slotserve.model.llama import EagerHalves
from slotserve.model.weights import LlamaWeights
from slotserve.native.blocks import BlockKernel, LayerInArgs, LayerOutArgs, Matrix, ScratchSpace


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix


class _StepBuffers:
    """One step's outputs and work space, shared by its layers."""

    def __init__(self, m: int, info: ModelInfo) -> None:
        attn_width = info.n_heads * info.head_dim
        self.qkv = torch.empty(m, (info.n_heads + 2 * info.n_kv_heads) * info.head_dim)
        self.gate_up = torch.empty(m, 2 * info.ffn_dim)
        self.scratch = ScratchSpace(m, max(info.dim, info.ffn_dim, attn_width))


class BlockHalves(EagerHalves):
    """The eager halves with ``qkv``, ``out`` and the head's norm as kernel calls (the
    weights' facts are the eager halves')."""

    def __init__(self, weights: LlamaWeights, info: ModelInfo, kernel: BlockKernel) -> None:
        if (reason := self.refusal(weights, info)) is not None:
            raise ValueError(f"the fused block halves do not cover this model: {reason}")
        super().__init__(weights, info)
        self.kernel = kernel
        self.layers = tuple(
            _Layer(
                layer.attn_norm.float().contiguous(),
                layer.mlp_norm.float().contiguous(),
                *(_matrix(linear) for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)),
            )
            for layer in weights.layers
        )
        self.final_norm = weights.norm.float().contiguous()

    @staticmethod
    def refusal(weights: LlamaWeights, info: ModelInfo) -> str | None:
        """Why these halves cannot run ``weights`` (None: they can)."""
        if info.qk_norm:
            return "per-head q/k norms"
        for layer in weights.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if not isinstance(linear, BlockLinear):
                    return "projections that are not all GGUF blocks"
                if linear.bias is not None:
                    return "projection biases"
        return None

    @property
    def kind(self) -> HalvesKind:
        return "block"

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._weights.embed[tokens].float().contiguous()

    def qkv(self, layer: int, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        info, weights = self.info, self.layers[layer]
        buffers = step.memo(("block", id(self)), lambda: _StepBuffers(x.shape[0], info))
        args = LayerInArgs(
            x.data_ptr(), x.shape[0], info.dim, weights.attn_norm.data_ptr(), info.norm_eps,
            weights.qkv, buffers.qkv.data_ptr(), info.n_heads + info.n_kv_heads,
            info.head_dim, step.cos.data_ptr(), step.sin.data_ptr(), buffers.scratch.struct,
            self.kernel.threads,
        )  # fmt: skip
        self.kernel.layer_in(args)
        return buffers.qkv

    def out(
        self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: StepContext
    ) -> torch.Tensor:
        info, weights = self.info, self.layers[layer]
        buffers = step.memo(("block", id(self)), lambda: _StepBuffers(x.shape[0], info))
        if attn.dtype != torch.float32 or not attn.is_contiguous():
            attn = attn.float().contiguous()
        args = LayerOutArgs(
            x.data_ptr(), x.shape[0], info.dim, attn.data_ptr(), attn.shape[1], weights.o,
            weights.mlp_norm.data_ptr(), info.norm_eps, weights.gate_up,
            buffers.gate_up.data_ptr(), weights.down, buffers.scratch.struct,
            self.kernel.threads,
        )  # fmt: skip
        self.kernel.layer_out(args)  # in place
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm in the kernel (row by row, as the layers' norms), then the head."""
        norm = self.kernel.rms_norm(x, self.final_norm, self.info.norm_eps)
        return self.weights.lm_head(norm)


def _matrix(linear: object) -> Matrix:
    assert isinstance(linear, BlockLinear)  # refusal() ran
    return Matrix.of(linear.packed, linear.kind)
