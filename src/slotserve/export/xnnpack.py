"""Lowering a Llama-family GGUF model's projections to XNNPACK, one method per layer half.

Methods of the program (``T`` tokens, dynamic up to ``max_tokens``):
- ``layer{i}_qkv(x[T, dim], cos[T, W], sin[T, W]) -> qkv[T, W]`` (``W = (H + 2·KVH)·hd``):
  the attention norm, the fused Q/K/V projection and RoPE (see `QKV` and
  `slotserve.model.layers.fused_rope_rows`);
- ``layer{i}_out(x[T, dim], attn[T, H*hd]) -> x[T, dim]``: the output projection, the residual,
  the MLP norm, gate/up, SwiGLU, down and the second residual;
- ``head(x[B, dim]) -> logits[B, vocab]``: the final norm and the (int8, per-row) head.

Attention between the two halves is the KV pool's ``update_and_attend``, so every layout works
unchanged. Exactness: XNNPACK's 4-bit weights are symmetric (it drops zero points), so a
block ``w = d·q + m`` is written as ``d·(q - 8)`` (int4, scale ``d``) plus the block-sum term
``sum(x over the block) · (m + 8d)``, a small dense product (1/32 of the weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.artifact.gguf_blocks import BLOCK, Q4Blocks, q4_blocks
from slotserve.info import ModelInfo
from slotserve.model import Model

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LayerProgramSpec:
    """What a program was built for: its file, the largest step and the model it serves."""

    path: Path
    max_tokens: int
    n_layers: int


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


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class QKV(nn.Module):
    """The attention norm, the fused Q/K/V projection and RoPE, as one ``[T, (H+2·KVH)·hd]``
    output (the executor views it as q, k and v).

    One output because XNNPACK cannot shrink several delegate outputs below the example's
    token count. RoPE is written over the fused row: ``y·cos + y[perm]·sin`` where ``perm``
    swaps the halves of each head and the caller's ``cos``/``sin`` rows carry the rotation's
    sign and are 1/0 over the value heads (`fused_rope_rows`)."""

    def __init__(self, info: ModelInfo, norm: torch.Tensor, qkv: Q4Blocks) -> None:
        super().__init__()
        self.eps = info.norm_eps
        self.norm = nn.Parameter(norm.clone(), requires_grad=False)
        self.qkv = ExactQ4Linear(qkv)
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
    def __init__(
        self,
        info: ModelInfo,
        mlp_norm: torch.Tensor,
        o: Q4Blocks,
        gate_up: Q4Blocks,
        down: Q4Blocks,
    ) -> None:
        super().__init__()
        self.eps = info.norm_eps
        self.mlp_norm = nn.Parameter(mlp_norm.clone(), requires_grad=False)
        self.o, self.gate_up, self.down = (
            ExactQ4Linear(o),
            ExactQ4Linear(gate_up),
            ExactQ4Linear(down),
        )

    def forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attn)
        gate_up = self.gate_up(_rms(x, self.mlp_norm, self.eps))
        # Slices, not chunk(): chunk's views of a dynamic-shape tensor fail ExecuTorch's
        # view pass (a static view spec on a dynamic base).
        half = gate_up.shape[-1] // 2
        y: torch.Tensor = x + self.down(F.silu(gate_up[:, :half]) * gate_up[:, half:])
        return y


class Head(nn.Module):
    def __init__(self, info: ModelInfo, norm: torch.Tensor, weight: torch.Tensor) -> None:
        super().__init__()
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerAxis

        self.eps = info.norm_eps
        self.norm = nn.Parameter(norm.clone(), requires_grad=False)
        self.head = nn.Linear(info.dim, info.vocab_size, bias=False)
        self.head.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
        # XNNPACK takes 8-bit weights per row only (not in blocks of 32): the Q8_0 head is
        # requantised per row, a small error next to the per-token activation quantisation.
        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0)
        )
        quantize_(self.head, config, filter_fn=lambda module, name: True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(_rms(x, self.norm, self.eps))
        return logits


def _layer_blocks(reader: Any, info: ModelInfo, layer: int, source: str) -> dict[str, Q4Blocks]:
    def blocks(kind: str, heads: int | None = None) -> Q4Blocks:
        found = q4_blocks(reader, f"blk.{layer}.{kind}.weight", source)
        if heads is None or info.arch != "llama":
            return found
        # Undo llama.cpp's interleaving of the two rotary halves of each Q/K head.
        order = torch.arange(heads * info.head_dim)
        order = order.view(heads, info.head_dim // 2, 2).transpose(1, 2).reshape(-1)
        return found.permute_rows(order)

    return {
        "qkv": Q4Blocks.cat(
            [
                blocks("attn_q", info.n_heads),
                blocks("attn_k", info.n_kv_heads),
                blocks("attn_v"),
            ]
        ),
        "o": blocks("attn_output"),
        "gate_up": Q4Blocks.cat([blocks("ffn_gate"), blocks("ffn_up")]),
        "down": blocks("ffn_down"),
    }


def _check_supported(model: Model) -> None:
    info = model.info
    if info.qkv_bias or info.qk_norm:
        raise ValueError(
            f"the XNNPACK program covers Llama/SmolLM layers; {info.arch} with qkv_bias="
            f"{info.qkv_bias} qk_norm={info.qk_norm} is not supported: use the torch executor"
        )
    if info.dim % BLOCK or info.ffn_dim % BLOCK:
        raise ValueError(f"dim={info.dim} and ffn_dim={info.ffn_dim} must be multiples of {BLOCK}")


def export_layer_program(
    model: Model,
    gguf_path: Path,
    out: Path,
    *,
    max_tokens: int = 512,
    progress: Progress | None = None,
) -> LayerProgramSpec:
    """Lower ``model`` (loaded from the Q4_0/Q4_1 GGUF ``gguf_path``) to ``out`` (.pte)."""
    import gguf
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from torch.export import Dim, export

    _check_supported(model)
    say = progress or (lambda message: None)
    info, weights = model.info, model.weights
    reader = gguf.GGUFReader(str(gguf_path))
    tokens = Dim("tokens", min=1, max=max_tokens)
    # Example inputs at the largest size: an input the runtime reads in place (not copied into
    # planned memory) keeps its example size as its capacity. Distinct tensors: export would
    # merge example inputs that are the same object into one input.
    x = torch.randn(max_tokens, info.dim)
    width = (info.n_heads + 2 * info.n_kv_heads) * info.head_dim
    cos, sin = torch.randn(max_tokens, width), torch.randn(max_tokens, width)
    programs: dict[str, Any] = {}
    began = time.monotonic()
    with torch.no_grad():
        for i, layer in enumerate(weights.layers):
            parts = _layer_blocks(reader, info, i, str(gguf_path))
            qkv = QKV(info, layer.attn_norm, parts["qkv"]).eval()
            programs[f"layer{i}_qkv"] = export(
                qkv, (x, cos, sin), dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens})
            )
            out_half = Out(info, layer.mlp_norm, parts["o"], parts["gate_up"], parts["down"]).eval()
            attn = torch.randn(max_tokens, info.n_heads * info.head_dim)
            programs[f"layer{i}_out"] = export(
                out_half, (x, attn), dynamic_shapes=({0: tokens}, {0: tokens})
            )
            say(f"exported layer {i + 1}/{info.n_layers}")
        head = Head(info, weights.norm, weights.embed if weights.tied else _dense(weights))
        programs["head"] = export(head.eval(), (x,), dynamic_shapes=({0: tokens},))
    say(f"exported {len(programs)} methods in {time.monotonic() - began:.0f} s; lowering")
    began = time.monotonic()
    # Inputs are not copied into planned memory: the runtime reads the caller's tensors.
    config = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False)
    )
    lowered = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
    buffer = lowered.to_executorch(config).buffer
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_suffix(".tmp")
    temp.write_bytes(buffer)
    temp.replace(out)
    say(f"lowered in {time.monotonic() - began:.0f} s: {out} ({len(buffer) / 2**20:.0f} MiB)")
    return LayerProgramSpec(out, max_tokens, info.n_layers)


def _dense(weights: Any) -> torch.Tensor:
    head = weights.lm_head
    if not hasattr(head, "weight"):
        raise ValueError("the head must be dense (fp32) to be lowered")
    weight: torch.Tensor = head.weight
    return weight
