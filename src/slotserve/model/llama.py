"""The Llama family's eager halves: torch ops, a pure function of (weights, inputs).

Covers Llama/SmolLM (GQA, SwiGLU, RMSNorm, RoPE incl. llama3 scaling), Qwen2 (QKV bias),
Qwen3 (per-head q/k RMSNorm), Gemma 3 (q/k norms, norms after attention and the MLP, a
GELU-gated MLP, scaled embeddings and a RoPE of its own for sliding-window layers) and
per-layer sliding windows (the pool applies them). Every
projection goes through the `Linear` seam, so the same halves run dense, int8 or GGUF
block weights. This is where a family is written; the fused halves and a bundle's program
compute the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotserve.info import ModelInfo
from slotserve.model.halves import HalvesKind, StepContext
from slotserve.model.layers import rms_norm, rotate
from slotserve.model.weights import LlamaWeights


class LoadedHalves:
    """What halves that hold a model's loaded tensors share, the eager and the fused block
    halves (`slotserve.model.block_forward.BlockHalves`): the weights and their facts."""

    def __init__(self, weights: LlamaWeights, info: ModelInfo) -> None:
        self._weights = weights
        self.info = info

    @property
    def weights(self) -> LlamaWeights:
        return self._weights

    @property
    def weight_bytes(self) -> int:
        return self._weights.nbytes

    @property
    def planned_method_bytes(self) -> int:
        return 0  # no program: no planned method arenas

    @property
    def mapped_weight_bytes(self) -> int:
        return 0  # every weight copied out of its file

    @property
    def max_step_tokens(self) -> int | None:
        return None


class EagerHalves(LoadedHalves):
    """`slotserve.model.halves.LayerHalves` in torch ops; a step's object is its
    `StepContext` (the rotation rows are all its layers share)."""

    @property
    def kind(self) -> HalvesKind:
        return "eager"

    def begin_step(self, context: StepContext) -> StepContext:
        return context

    def end_step(self, step: StepContext) -> None:
        pass  # nothing held beyond the step's context

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self._weights.embed[tokens]
        return rows * self.info.embed_scale if self.info.embed_scale != 1.0 else rows

    def qkv(self, layer: int, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The attention norm, the fused Q/K/V projection, q/k norms and RoPE."""
        info, weights = self.info, self._weights.layers[layer]
        rows = weights.qkv(rms_norm(x, weights.attn_norm, info.norm_eps))
        q_width = info.n_heads * info.head_dim
        q, k, v = torch.split(rows, [q_width, info.kv_dim, info.kv_dim], dim=-1)
        q = q.view(-1, info.n_heads, info.head_dim)
        k = k.view(-1, info.n_kv_heads, info.head_dim)
        if weights.q_norm is not None and weights.k_norm is not None:
            q = rms_norm(q, weights.q_norm, info.norm_eps)
            k = rms_norm(k, weights.k_norm, info.norm_eps)
        cos, sin = step.rotation(info.local_rope(layer))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return torch.cat([q.flatten(1), k.flatten(1), v], dim=1)

    def out(
        self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: StepContext
    ) -> torch.Tensor:
        """The output projection and residual, then the MLP and its residual."""
        info, weights = self.info, self._weights.layers[layer]
        x = x + _post_norm(weights.o(attn), weights.post_attn_norm, info.norm_eps)
        gate, up = weights.gate_up(rms_norm(x, weights.mlp_norm, info.norm_eps)).chunk(2, -1)
        act = F.gelu(gate, approximate="tanh") if info.activation == "gelu_tanh" else F.silu(gate)
        return x + _post_norm(weights.down(act * up), weights.post_mlp_norm, info.norm_eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head."""
        return self._weights.lm_head(rms_norm(x, self._weights.norm, self.info.norm_eps))


def _post_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's norm on a block's output before its residual; the identity elsewhere."""
    return rms_norm(x, weight, eps) if weight is not None else x
