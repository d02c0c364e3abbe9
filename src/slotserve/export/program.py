"""The modules a bundle's program is lowered from: a Llama-family model cut at attention.

Methods (``T`` tokens, dynamic up to the bundle's ``max_tokens``; one step mixes prefill
chunks and decode tokens on this axis):
- ``embed(tokens[T]) -> x[T, dim]`` (`Embed`), or for a tied embedding
  ``embed(tokens[T], rows[vocab, dim][, scales[vocab]]) -> x[T, dim]`` (`TiedEmbed`: the
  head's stored weights, passed in by the runtime, so the table is stored once);
- ``layer{i}_qkv(x[T, dim], cos[T, W], sin[T, W]) -> qkv[T, W]`` (``W = (H + 2·KVH)·hd``):
  the attention norm, the fused Q/K/V projection and RoPE (see `QKV` and
  `slotserve.model.layers.fused_rope_rows`);
- ``layer{i}_out(x[T, dim], attn[T, H*hd]) -> x[T, dim]``: the output projection, the residual,
  the MLP norm, gate/up, SwiGLU, down and the second residual;
- ``head(x[B, dim]) -> logits[B, vocab]``: the final norm and the head.

Attention between the two halves is the KV pool's ``update_and_attend``, so every layout works
unchanged and no method owns KV state. How a projection is represented is the `Linears`
builder's choice: fp32 (`dense_linears`), or int4 weights with int8 dynamic activations
(`int4_linears`), which stores the Q4 blocks of a GGUF file loaded with them exactly
(`Q4BlockLinear`, from the model's `BlockLinear` weights), optionally in two passes
(`TwoPass`). Norms, the embedding and the head are read dense (blocks dequantised); a
tied embedding is then stored only as the head's weights (fp32, or its int8 rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.export.blocks import Q4Blocks, q4_blocks
from slotserve.info import ModelInfo
from slotserve.model import Model
from slotserve.model.gguf_linear import BLOCK, BlockEmbedding, BlockLinear
from slotserve.model.layers import DenseLinear, Linear
from slotserve.model.weights import LlamaWeights

LinearKind = Literal["qkv", "o", "gate", "up", "down"]
KINDS: tuple[LinearKind, ...] = ("qkv", "o", "gate", "up", "down")
Linears = Callable[[int, LinearKind], nn.Module]
"""Builds the projection ``kind`` of layer ``i`` as a module to lower."""
log = logging.getLogger("slotserve")


class Q4BlockLinear(nn.Module):
    """``y = x @ W.T`` for Q4 blocks ``W = d·q + m``, written as ``d·(q − 8)`` (XNNPACK's
    symmetric int4 blocks: the file's 4-bit values and scales, stored exactly; XNNPACK rounds
    block scales to bf16 when it packs them, a relative 2⁻⁹ at most) plus the offsets
    ``m + 8d`` times each block's input sum (int8 rows; zero for Q4_0)."""

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
        offset = blocks.m + 8 * blocks.d
        # The offsets are 1/32 of the weights; in fp32 (4 bytes each against half a byte a
        # weight) they would be a sizeable part of the program, so they are kept as int8
        # rows (a small error on a small term).
        self.offset = int8_rows_linear(offset) if offset.any() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.linear(x)
        if self.offset is not None:  # Q4_1; Q4_0's offset m + 8d is 0
            # A reshape and a sum (a portable op between two delegate calls), not a product
            # with a 0/1 matrix: XNNPACK packs each linear's weights per method, and those
            # matrices would be resident in every layer for no measurable speed.
            y = y + self.offset(x.view(x.shape[0], -1, BLOCK).sum(-1))
        return y


def activation_residual(x: torch.Tensor) -> torch.Tensor:
    """What XNNPACK's per-token int8 quantisation of ``x`` loses, ``x − round(x/s)·s``, with
    its asymmetric scale ``s = (max(x, 0) − min(x, 0)) / 255`` per row (the zero point
    cancels in the dequantised value)."""
    low = x.amin(-1, keepdim=True).clamp(max=0.0)
    high = x.amax(-1, keepdim=True).clamp(min=0.0)
    scale = (high - low).clamp(min=1e-30) / 255
    # floor(v + 0.5), not round: XNNPACK runs floor; ties (where the two differ) are rare.
    return x - torch.floor(x / scale + 0.5) * scale


class TwoPass(nn.Module):
    """``y = W·x`` for a linear whose kernel quantises its input to int8 per token (``Q``),
    as ``W·Q(x) + W·Q(x − Q(x))``: the second pass runs on what the first one's activation
    quantisation lost, so the sum is as close to ``W·x`` as the weights allow.

    Both passes are one call on twice the rows, so the weights are read once a step. Per-token
    int8 is coarser than the int8 blocks of 32 llama.cpp quantises activations in, so a
    one-pass bundle agrees with llama.cpp's reference on fewer positions than the fp32
    model; two passes bring it back to about the fp32 model's agreement. The price: longer
    decode steps (the residual's small ops and portable ops a projection, twice the rows)
    and more resident memory at load. Figures: docs/EXECUTORCH-NOTES.md."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        y: torch.Tensor = self.inner(torch.cat([x, activation_residual(x)]))
        # The passes' sum as twice their mean over a 4D view: XNNPACK runs view, permute and
        # mean; slices of a dynamic size would be portable ops, whose outputs take planned
        # memory in every method (resident for the bundle's life, method by method).
        width = y.shape[1]
        passes = y.view(2, rows, width, 1).permute(1, 2, 0, 3)
        return passes.mean((2, 3), keepdim=True).view(rows, width) * 2


def in_two_passes(linears: Linears) -> Linears:
    """``linears``' projections, each wrapped in `TwoPass`."""
    return lambda i, kind: TwoPass(linears(i, kind))


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


class RMSNorm(nn.Module):
    """``x / rms(x) · weight``. The mean of squares is a product with a constant ``1/dim``
    row: XNNPACK lowers a linear but not a mean over the last axis, and an op it does not
    lower splits the method into several delegate calls (each with its own overhead)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
        self.mean = nn.Parameter(
            torch.full((1, weight.numel()), 1 / weight.numel()), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x * torch.rsqrt(F.linear(x * x, self.mean) + self.eps) * self.weight
        return y


class Embed(nn.Module):
    """Token rows: fp32, or (``int8=True``) int8 in blocks of 32 with one scale each, as GGUF's
    Q8_0 stores them. Requantising a Q8_0 file's rows this way gives back its blocks exactly
    (llama.cpp sets each block's scale to its largest magnitude / 127)."""

    def __init__(self, weight: torch.Tensor, int8: bool) -> None:
        super().__init__()
        weight = weight.float()
        vocab, dim = weight.shape
        self.int8 = int8 and dim % BLOCK == 0
        if self.int8:
            blocks = weight.view(vocab, dim // BLOCK, BLOCK)
            scale = blocks.abs().amax(-1, keepdim=True) / 127
            rows = torch.round(blocks / scale.clamp_min(1e-30)).clamp(-127, 127)
            # fp16 scales, as Q8_0 stores them.
            rows, scale = rows.to(torch.int8).view(vocab, dim), scale.view(vocab, -1).half()
        else:
            rows, scale = weight.clone(), torch.ones(vocab, 1)
        self.rows = nn.Parameter(rows, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.int8:
            return self.rows[tokens]
        blocks = self.rows[tokens].float().view(tokens.shape[0], -1, BLOCK)
        scales = self.scale[tokens].float().unsqueeze(-1)
        rows: torch.Tensor = (blocks * scales).view(tokens.shape[0], -1)
        return rows


class TiedEmbed(nn.Module):
    """Token rows of a tied embedding, read from the head's own weights: the runtime maps
    the head's weights in ``weights.ptd`` and passes them in, and the method reads them in
    place (its inputs are not copied), so the table is stored and resident once. ``rows`` is
    the head's ``[vocab, dim]`` fp32 weight, or (``int8=True``) its int8 rows with one scale
    each (the head's XNNPACK weights, `int8_rows_linear`). Inputs 1 and 2 are static
    (`static_inputs`): only the token axis is dynamic."""

    static_inputs = (1, 2)

    def __init__(self, int8: bool) -> None:
        super().__init__()
        self.int8 = int8

    def forward(
        self, tokens: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        picked = rows[tokens]
        if scales is None:
            return picked
        scaled: torch.Tensor = picked.float() * scales[tokens].unsqueeze(-1)
        return scaled


@dataclass(frozen=True)
class TiedRows:
    """The tensors a tied embedding is read from (the head's weights, as stored): fp32
    ``rows``, or int8 ``rows`` and fp32 ``scales`` (one a row)."""

    rows: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rows,) if self.scales is None else (self.rows, self.scales)


def tied_rows(head: nn.Module) -> TiedRows:
    """The stored weights of a head built by `dense_linear` or `int8_rows_linear` (inside a
    `TwoPass` or not): what `TiedEmbed` reads."""
    while isinstance(head, TwoPass):
        head = head.inner
    assert isinstance(head, nn.Linear), head
    weight = head.weight
    qdata = getattr(weight, "qdata", None)
    if qdata is None:
        return TiedRows(weight.detach().float().contiguous())
    scale: torch.Tensor = weight.scale  # type: ignore[attr-defined]  # torchao's tensor
    scale = scale.detach().float().reshape(-1).contiguous()
    zero = getattr(weight, "zero_point", None)
    if zero is not None and bool(zero.any()):
        raise ValueError("a tied head's int8 rows must be symmetric (zero point 0)")
    return TiedRows(qdata.detach().to(torch.int8).contiguous(), scale)


class QKV(nn.Module):
    """The attention norm, the fused Q/K/V projection and RoPE, as one ``[T, (H+2·KVH)·hd]``
    output (the executor views it as q, k and v).

    One output because XNNPACK cannot shrink several delegate outputs below the example's
    token count. RoPE is written over the fused row: ``y·cos + y[perm]·sin`` where ``perm``
    swaps the halves of each head and the caller's ``cos``/``sin`` rows carry the rotation's
    sign and are 1/0 over the value heads (`fused_rope_rows`)."""

    def __init__(self, info: ModelInfo, norm: torch.Tensor, qkv: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(norm, info.norm_eps)
        self.qkv = qkv
        self.head_dim = info.head_dim
        half = info.head_dim // 2
        within = torch.cat([torch.arange(half, info.head_dim), torch.arange(half)])
        # Swapping the halves of every head: one [hd, hd] permutation applied per head, as a
        # linear (an index_select would split the delegate).
        self.swap = nn.Parameter(torch.eye(info.head_dim)[within], requires_grad=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = self.qkv(self.norm(x))
        swapped = F.linear(y.view(-1, self.head_dim), self.swap).view(y.shape)
        rotated: torch.Tensor = y * cos + swapped * sin
        return rotated


class Out(nn.Module):
    """The output projection and residual, then the MLP block and its residual."""

    def __init__(
        self,
        info: ModelInfo,
        mlp_norm: torch.Tensor,
        o: nn.Module,
        gate: nn.Module,
        up: nn.Module,
        down: nn.Module,
    ) -> None:
        super().__init__()
        self.mlp_norm = RMSNorm(mlp_norm, info.norm_eps)
        self.o, self.gate, self.up, self.down = o, gate, up, down

    def forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attn)
        h = self.mlp_norm(x)
        # Gate and up as two linears, not one fused and sliced: slices split the delegate.
        y: torch.Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return y


class Head(nn.Module):
    def __init__(self, info: ModelInfo, norm: torch.Tensor, head: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(norm, info.norm_eps)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(x))
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
    """The model's weights, if its layers are the ones these modules express and each
    projection is fp32 or a GGUF file's blocks (`BlockLinear`)."""
    info = model.info
    if info.qkv_bias or info.qk_norm:
        raise ValueError(
            f"export covers Llama/SmolLM layers; {info.arch} with qkv_bias={info.qkv_bias} "
            f"qk_norm={info.qk_norm} is not supported yet: serve it with the torch executor"
        )
    weights = model.weights
    if weights is None:
        raise ValueError(
            f"{model.source} is a bundle: its weights were fixed at export; export the model "
            "it was exported from"
        )
    linears = [weights.lm_head]
    for layer in weights.layers:
        linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
    readable = all(isinstance(x, DenseLinear | BlockLinear) for x in linears)
    if not readable or not isinstance(weights.embed, torch.Tensor | BlockEmbedding):
        raise ValueError(
            f"export reads the model's fp32 weights or its GGUF blocks, but {model.source} was "
            "loaded with other quantised ones; load it with weights='gguf' or 'fp32' (drop "
            "--weights)"
        )
    return weights


def dense_weight(linear: Linear) -> torch.Tensor:
    """The fp32 weight of a projection (a GGUF file's blocks dequantised)."""
    if isinstance(linear, BlockLinear):
        return linear.dequantize()
    assert isinstance(linear, DenseLinear), linear  # check_supported ran
    return linear.weight


def dense_embedding(weights: LlamaWeights) -> torch.Tensor:
    if isinstance(weights.embed, BlockEmbedding):
        return weights.embed.table.dequantize()
    assert isinstance(weights.embed, torch.Tensor), weights.embed  # check_supported ran
    return weights.embed


def layer_linear(weights: LlamaWeights, layer: int, kind: LinearKind) -> tuple[Linear, slice]:
    """The model's projection that holds ``kind`` of ``layer``, and ``kind``'s rows in it
    (gate and up are halves of the fused gate_up)."""
    found = weights.layers[layer]
    if kind in ("gate", "up"):
        half = found.gate_up.shape[0] // 2
        return found.gate_up, slice(0, half) if kind == "gate" else slice(half, None)
    linear: Linear = getattr(found, kind)
    return linear, slice(None)


def layer_weight(weights: LlamaWeights, layer: int, kind: LinearKind) -> torch.Tensor:
    """The fp32 weight of projection ``kind``."""
    linear, rows = layer_linear(weights, layer, kind)
    return dense_weight(linear)[rows]


def dense_linears(weights: LlamaWeights) -> Linears:
    """fp32 projections from the loaded weights (a GGUF file's blocks dequantised)."""
    return lambda i, kind: dense_linear(layer_weight(weights, i, kind))


def int4_linears(weights: LlamaWeights, info: ModelInfo, source: str) -> Linears:
    """int4 projections: where the model holds Q4 blocks (a Q4_0/Q4_1 GGUF loaded with
    its blocks, ``weights='gguf'`` or ``'auto'``), those blocks exactly (`Q4BlockLinear`);
    otherwise its fp32 weights requantised in symmetric groups of 32."""
    if info.dim % BLOCK or info.ffn_dim % BLOCK:
        raise ValueError(
            f"int4 groups of {BLOCK} need dim ({info.dim}) and ffn_dim ({info.ffn_dim}) "
            f"to be multiples of {BLOCK}; export with --quant fp32"
        )
    projections = [
        layer_linear(weights, i, kind)[0] for i in range(info.n_layers) for kind in KINDS
    ]
    requantised = sum(not _is_q4(linear) for linear in projections)
    if requantised and Path(source).suffix == ".gguf":
        log.warning(
            "%d of %d projections of %s are not Q4 blocks in the loaded model: requantised "
            "in int4 groups of %d (a Q4 file's blocks are kept exactly when it is loaded with "
            "weights='gguf')",
            requantised,
            len(projections),
            source,
            BLOCK,
        )

    def build(i: int, kind: LinearKind) -> nn.Module:
        linear, rows = layer_linear(weights, i, kind)
        if _is_q4(linear):
            return Q4BlockLinear(q4_blocks(linear).rows(rows))
        return int4_group_linear(dense_weight(linear)[rows])

    return build


def _is_q4(linear: Linear) -> TypeGuard[BlockLinear]:
    return isinstance(linear, BlockLinear) and linear.kind == "Q4_1"


def head_weight(weights: LlamaWeights) -> torch.Tensor:
    return dense_embedding(weights) if weights.tied else dense_weight(weights.lm_head)
