"""The modules a bundle's program is lowered from: a Llama-family model cut at attention.

Methods (``T`` tokens, dynamic up to the bundle's ``max_tokens``; one step mixes prefill
chunks and decode tokens on this axis):
- ``embed(tokens[T]) -> x[T, dim]``;
- ``layer{i}_qkv(x[T, dim], cos[T, W], sin[T, W]) -> qkv[T, W]`` (``W = (H + 2·KVH)·hd``):
  the attention norm, the fused Q/K/V projection and RoPE (see `QKV` and
  `slotserve.model.layers.fused_rope_rows`);
- ``layer{i}_out(x[T, dim], attn[T, H*hd]) -> x[T, dim]``: the output projection, the residual,
  the MLP norm, gate/up, SwiGLU, down and the second residual;
- ``head(x[B, dim]) -> logits[B, vocab]``: the final norm and the head.

Attention between the two halves is the KV pool's ``update_and_attend``, so every layout works
unchanged and no method owns KV state. How a projection is represented is the `Linears`
builder's choice: fp32 (`dense_linears`), or int4 weights with int8 dynamic activations
(`int4_linears`), which keeps a Q4_0/Q4_1 GGUF file's blocks exactly (`ExactQ4Linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.artifact.gguf_blocks import BLOCK, Q4Blocks, q4_blocks
from slotserve.info import ModelInfo
from slotserve.model import Model
from slotserve.model.layers import DenseLinear, Linear
from slotserve.model.weights import LlamaWeights

LinearKind = Literal["qkv", "o", "gate_up", "down"]
Linears = Callable[[int, LinearKind], nn.Module]
"""Builds the projection ``kind`` of layer ``i`` as a module to lower."""


class ExactQ4Linear(nn.Module):
    """``y = x @ W.T`` for Q4 blocks ``W = d·q + m``, exactly representable in XNNPACK."""

    def __init__(self, blocks: Q4Blocks) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
            IntxUnpackedToInt8Tensor,
        )

        rows, cols = blocks.q.shape
        symmetric = blocks.d.repeat_interleave(BLOCK, 1) * (blocks.q.float() - 8)
        weight = IntxUnpackedToInt8Tensor.from_hp(
            symmetric,
            (1, BLOCK),
            torch.int4,  # type: ignore[attr-defined]  # not in torch's stubs
            activation_quantization="int8_asym_per_token",
            intx_choose_qparams_algorithm=None,
            custom_scale=blocks.d.clone(),
            custom_zero_point=torch.zeros_like(blocks.d, dtype=torch.int8),
        )
        self.linear = nn.Linear(cols, rows, bias=False)
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        self.offset = nn.Parameter(blocks.m + 8 * blocks.d, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block_sums = x.view(x.shape[0], -1, BLOCK).sum(-1)
        y: torch.Tensor = self.linear(x) + F.linear(block_sums, self.offset)
        return y


def dense_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
    return linear


def int8_rows_linear(weight: torch.Tensor) -> nn.Linear:
    """int8 weights per row (the one 8-bit granularity XNNPACK takes), int8 activations."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    linear = dense_linear(weight)
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int8, weight_granularity=PerAxis(0)
    )
    quantize_(linear, config, filter_fn=lambda module, name: True)
    return linear


def int4_group_linear(weight: torch.Tensor) -> nn.Linear:
    """Symmetric int4 weights in groups of 32 requantised from ``weight``, int8 activations
    (for a model whose file has no 4-bit blocks to keep)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    linear = dense_linear(weight)
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4,  # type: ignore[attr-defined]  # not in torch's stubs
        weight_granularity=PerGroup(BLOCK),
    )
    quantize_(linear, config, filter_fn=lambda module, name: True)
    return linear


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Embed(nn.Module):
    """Token rows: fp32, or int8 per row with a scale (``int8=True``)."""

    def __init__(self, weight: torch.Tensor, int8: bool) -> None:
        super().__init__()
        weight = weight.float()
        if int8:
            scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            rows = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
        else:
            scale, rows = torch.ones(weight.shape[0], 1), weight.clone()
        self.int8 = int8
        self.rows = nn.Parameter(rows, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.int8:
            return self.rows[tokens]
        rows: torch.Tensor = self.rows[tokens].float() * self.scale[tokens]
        return rows


class QKV(nn.Module):
    """The attention norm, the fused Q/K/V projection and RoPE, as one ``[T, (H+2·KVH)·hd]``
    output (the executor views it as q, k and v).

    One output because XNNPACK cannot shrink several delegate outputs below the example's
    token count. RoPE is written over the fused row: ``y·cos + y[perm]·sin`` where ``perm``
    swaps the halves of each head and the caller's ``cos``/``sin`` rows carry the rotation's
    sign and are 1/0 over the value heads (`fused_rope_rows`)."""

    def __init__(self, info: ModelInfo, norm: torch.Tensor, qkv: nn.Module) -> None:
        super().__init__()
        self.eps = info.norm_eps
        self.norm = nn.Parameter(norm.float().clone(), requires_grad=False)
        self.qkv = qkv
        heads = info.n_heads + 2 * info.n_kv_heads
        half = info.head_dim // 2
        within = torch.cat([torch.arange(half, info.head_dim), torch.arange(half)])
        starts = torch.arange(heads).repeat_interleave(info.head_dim) * info.head_dim
        self.register_buffer("swap", starts + within.repeat(heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = self.qkv(_rms(x, self.norm, self.eps))
        rotated: torch.Tensor = y * cos + y.index_select(1, self.swap) * sin
        return rotated


class Out(nn.Module):
    """The output projection and residual, then the MLP block and its residual."""

    def __init__(
        self,
        info: ModelInfo,
        mlp_norm: torch.Tensor,
        o: nn.Module,
        gate_up: nn.Module,
        down: nn.Module,
    ) -> None:
        super().__init__()
        self.eps = info.norm_eps
        self.mlp_norm = nn.Parameter(mlp_norm.float().clone(), requires_grad=False)
        self.o, self.gate_up, self.down = o, gate_up, down

    def forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attn)
        gate_up = self.gate_up(_rms(x, self.mlp_norm, self.eps))
        # Slices, not chunk(): chunk's views of a dynamic-shape tensor fail ExecuTorch's
        # view pass (a static view spec on a dynamic base).
        half = gate_up.shape[-1] // 2
        y: torch.Tensor = x + self.down(F.silu(gate_up[:, :half]) * gate_up[:, half:])
        return y


class Head(nn.Module):
    def __init__(self, info: ModelInfo, norm: torch.Tensor, head: nn.Module) -> None:
        super().__init__()
        self.eps = info.norm_eps
        self.norm = nn.Parameter(norm.float().clone(), requires_grad=False)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(_rms(x, self.norm, self.eps))
        return logits


class PairId(nn.Module):
    """Returns the export's pairing id, stored with the weights (see `Manifest.pair_id`)."""

    pair_id: torch.Tensor

    def __init__(self, pair_id: bytes) -> None:
        super().__init__()
        self.register_buffer("pair_id", torch.tensor(list(pair_id), dtype=torch.uint8))

    def forward(self) -> torch.Tensor:
        pair_id: torch.Tensor = self.pair_id.clone()
        return pair_id


def check_supported(model: Model) -> LlamaWeights:
    """The model's fp32 weights, if its layers are the ones these modules express."""
    info = model.info
    if info.qkv_bias or info.qk_norm:
        raise ValueError(
            f"export covers Llama/SmolLM layers; {info.arch} with qkv_bias={info.qkv_bias} "
            f"qk_norm={info.qk_norm} is not supported yet: serve it with the torch executor"
        )
    weights = model.require_weights()
    if not isinstance(weights.lm_head, DenseLinear) or not isinstance(
        weights.layers[0].qkv, DenseLinear
    ):
        raise ValueError(
            f"export reads the model's fp32 weights, but {model.source} was loaded with "
            "quantised ones; load it with weights='fp32' (drop --weights)"
        )
    return weights


def dense_weight(linear: Linear) -> torch.Tensor:
    assert isinstance(linear, DenseLinear), linear  # check_supported ran
    return linear.weight


def dense_linears(weights: LlamaWeights) -> Linears:
    """fp32 projections from the loaded weights."""
    return lambda i, kind: dense_linear(dense_weight(getattr(weights.layers[i], kind)))


def int4_linears(weights: LlamaWeights, info: ModelInfo, source: str) -> Linears:
    """int4 projections: a Q4_0/Q4_1 GGUF file's blocks exactly; otherwise the fp32 weights
    requantised in symmetric groups of 32."""
    if info.dim % BLOCK or info.ffn_dim % BLOCK:
        raise ValueError(
            f"int4 groups of {BLOCK} need dim ({info.dim}) and ffn_dim ({info.ffn_dim}) "
            f"to be multiples of {BLOCK}; export with --quant fp32"
        )
    reader = _q4_reader(source)
    if reader is None:
        return lambda i, kind: int4_group_linear(dense_weight(getattr(weights.layers[i], kind)))
    return lambda i, kind: ExactQ4Linear(_q4_layer_blocks(reader, info, i, kind, source))


def _q4_reader(source: str) -> Any | None:
    """A reader of ``source`` if it is a GGUF file whose projections are Q4_0/Q4_1 blocks."""
    if Path(source).suffix != ".gguf":
        return None
    import gguf

    reader = gguf.GGUFReader(source)
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")}
    return reader if kinds & {"Q4_0", "Q4_1"} else None


_GGUF_PARTS: dict[LinearKind, tuple[str, ...]] = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def _q4_layer_blocks(
    reader: Any, info: ModelInfo, layer: int, kind: LinearKind, source: str
) -> Q4Blocks:
    rotary_heads = {"attn_q": info.n_heads, "attn_k": info.n_kv_heads}

    def blocks(part: str) -> Q4Blocks:
        found = q4_blocks(reader, f"blk.{layer}.{part}.weight", source)
        heads = rotary_heads.get(part)
        if heads is None or info.arch != "llama":
            return found
        # Undo llama.cpp's interleaving of the two rotary halves of each Q/K head.
        order = torch.arange(heads * info.head_dim)
        order = order.view(heads, info.head_dim // 2, 2).transpose(1, 2).reshape(-1)
        return found.permute_rows(order)

    return Q4Blocks.cat([blocks(part) for part in _GGUF_PARTS[kind]])


def head_weight(weights: LlamaWeights) -> torch.Tensor:
    return weights.embed if weights.tied else dense_weight(weights.lm_head)
