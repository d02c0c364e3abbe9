"""The Llama-family forward pass as a pure function of (weights, tokens, batch, kv).

Covers Llama/SmolLM (GQA, SwiGLU, RMSNorm, RoPE incl. llama3 scaling), Qwen2 (QKV bias),
Qwen3 (per-head q/k RMSNorm) and per-layer sliding windows. No state lives here: the KV
cache is an argument and is touched only through ``update_and_attend``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotserve.info import ModelInfo
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model.layers import RopeTables, rms_norm
from slotserve.model.weights import LayerWeights, LlamaWeights


def forward_hidden(
    weights: LlamaWeights,
    info: ModelInfo,
    rope: RopeTables,
    tokens: torch.Tensor,
    batch: StepBatch,
    kv: KVStore,
) -> torch.Tensor:
    """Final-norm hidden states ``[T, dim]`` for the step's flattened tokens."""
    x = weights.embed[tokens]
    for index, layer in enumerate(weights.layers):
        x = x + _attention(layer, info, rope, x, batch, kv, index)
        x = x + _mlp(layer, info, x)
    return rms_norm(x, weights.norm, info.norm_eps)


def _attention(
    layer: LayerWeights,
    info: ModelInfo,
    rope: RopeTables,
    x: torch.Tensor,
    batch: StepBatch,
    kv: KVStore,
    index: int,
) -> torch.Tensor:
    h = rms_norm(x, layer.attn_norm, info.norm_eps)
    q_width = info.n_heads * info.head_dim
    q, k, v = torch.split(layer.qkv(h), [q_width, info.kv_dim, info.kv_dim], dim=-1)
    q = q.view(-1, info.n_heads, info.head_dim)
    k = k.view(-1, info.n_kv_heads, info.head_dim)
    v = v.view(-1, info.n_kv_heads, info.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = rms_norm(q, layer.q_norm, info.norm_eps)
        k = rms_norm(k, layer.k_norm, info.norm_eps)
    q = rope.apply(q, batch.positions)
    k = rope.apply(k, batch.positions)
    return layer.o(kv.update_and_attend(index, q, k, v, batch))


def _mlp(layer: LayerWeights, info: ModelInfo, x: torch.Tensor) -> torch.Tensor:
    h = rms_norm(x, layer.mlp_norm, info.norm_eps)
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up)
