"""Model weights as plain tensors, built from a state dict with Hugging Face names.

Q/K/V and gate/up projections are fused into one matmul each: fewer, larger GEMMs are
faster on CPU at the small batch sizes of a device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo
from slotserve.model.layers import DenseLinear, Linear


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass(frozen=True)
class LlamaWeights:
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: Linear
    tied: bool

    @property
    def nbytes(self) -> int:
        """Resident bytes of all weights (a tied lm_head is counted once)."""
        total = self.embed.nbytes + self.norm.nbytes
        if not self.tied:
            total += self.lm_head.nbytes
        for layer in self.layers:
            total += layer.attn_norm.nbytes + layer.mlp_norm.nbytes
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes
            total += layer.down.nbytes
            for norm in (layer.q_norm, layer.k_norm):
                total += norm.nbytes if norm is not None else 0
        return total

    @property
    def n_params(self) -> int:
        return self.nbytes // self.embed.element_size()


class _StateDict:
    """Checked access to a state dict: a missing or misshapen tensor is an ArtifactError."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str, dtype: torch.dtype):
        self.tensors, self.source, self.dtype = tensors, source, dtype

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ArtifactError(self.source, f"tensor missing, expected shape {shape}", name)
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ArtifactError(
                self.source, f"tensor has shape {tuple(tensor.shape)}, expected {shape}", name
            )
        return tensor.to(self.dtype)

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if name in self.tensors else None


def build_weights(
    info: ModelInfo,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    dtype: torch.dtype = torch.float32,
) -> LlamaWeights:
    """Assemble `LlamaWeights` from tensors named as in Hugging Face Llama/Qwen checkpoints."""
    sd = _StateDict(tensors, source, dtype)
    embed = sd.get("model.embed_tokens.weight", (info.vocab_size, info.dim))
    layers = tuple(_build_layer(info, sd, i) for i in range(info.n_layers))
    norm = sd.get("model.norm.weight", (info.dim,))
    head = sd.maybe("lm_head.weight", (info.vocab_size, info.dim))
    if head is None and not info.tied_embeddings:
        raise ArtifactError(source, "untied model has no lm_head", "lm_head.weight")
    tied = head is None
    lm_head = DenseLinear(embed if tied else head)  # type: ignore[arg-type]
    return LlamaWeights(embed, layers, norm, lm_head, tied)


def _build_layer(info: ModelInfo, sd: _StateDict, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    q_out, kv_out, dim = info.n_heads * info.head_dim, info.kv_dim, info.dim
    q = sd.get(p + "self_attn.q_proj.weight", (q_out, dim))
    k = sd.get(p + "self_attn.k_proj.weight", (kv_out, dim))
    v = sd.get(p + "self_attn.v_proj.weight", (kv_out, dim))
    bias = None
    if info.qkv_bias:
        bias = torch.cat(
            [
                sd.get(p + "self_attn.q_proj.bias", (q_out,)),
                sd.get(p + "self_attn.k_proj.bias", (kv_out,)),
                sd.get(p + "self_attn.v_proj.bias", (kv_out,)),
            ]
        )
    qk_shape = (info.head_dim,)
    gate = sd.get(p + "mlp.gate_proj.weight", (info.ffn_dim, dim))
    up = sd.get(p + "mlp.up_proj.weight", (info.ffn_dim, dim))
    return LayerWeights(
        attn_norm=sd.get(p + "input_layernorm.weight", (dim,)),
        qkv=DenseLinear(torch.cat([q, k, v]), bias),
        q_norm=sd.get(p + "self_attn.q_norm.weight", qk_shape) if info.qk_norm else None,
        k_norm=sd.get(p + "self_attn.k_norm.weight", qk_shape) if info.qk_norm else None,
        o=DenseLinear(sd.get(p + "self_attn.o_proj.weight", (dim, q_out))),
        mlp_norm=sd.get(p + "post_attention_layernorm.weight", (dim,)),
        gate_up=DenseLinear(torch.cat([gate, up])),
        down=DenseLinear(sd.get(p + "mlp.down_proj.weight", (dim, info.ffn_dim))),
    )
