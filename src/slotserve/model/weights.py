"""Model weights as plain tensors, built from a state dict with Hugging Face names.

Q/K/V and gate/up projections are fused into one matmul each: fewer, larger GEMMs are
faster on CPU at the small batch sizes of a device. A state dict may hold some matrices as
a GGUF file's blocks (`BlockLinear`): they stay blocks where all parts of a projection share
one block type, and stack as `StackedBlocks` where their types differ (llama.cpp's
K-quant mixes give a layer's V rows another type than its Q and K rows).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo
from slotserve.memory import trim_heap
from slotserve.model.gguf_linear import BlockEmbedding, BlockLinear, StackedBlocks
from slotserve.model.layers import DenseLinear, Linear

Part = torch.Tensor | BlockLinear  # one state-dict entry
Embedding = torch.Tensor | BlockEmbedding


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
    post_attn_norm: torch.Tensor | None = None  # Gemma: after attention, before the residual
    post_mlp_norm: torch.Tensor | None = None  # and after the MLP

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        """Every norm weight of the layer."""
        optional = (self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm)
        return (self.attn_norm, self.mlp_norm, *(n for n in optional if n is not None))


@dataclass(frozen=True)
class LlamaWeights:
    embed: Embedding
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
            total += sum(norm.nbytes for norm in layer.norms)
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes
            total += layer.down.nbytes
        return total

    @property
    def n_params(self) -> int:
        """Parameters (a tied head counted once), whatever their storage."""
        vocab, dim = self.embed.shape
        total = vocab * dim + dim + (0 if self.tied else _params(self.lm_head))
        for layer in self.layers:
            total += sum(_params(x) for x in (layer.qkv, layer.o, layer.gate_up))
            total += _params(layer.down) + sum(norm.numel() for norm in layer.norms)
        return total


def _params(linear: Linear) -> int:
    rows, cols = linear.shape
    bias = getattr(linear, "bias", None)
    return rows * cols + (bias.numel() if bias is not None else 0)


class _StateDict:
    """Checked access to a state dict: a missing or misshapen tensor is an ArtifactError.
    With ``take``, an entry leaves ``tensors`` as it is read (see `build_weights`)."""

    def __init__(
        self, tensors: Mapping[str, Part], source: str, dtype: torch.dtype, take: bool = False
    ):
        self.tensors, self.source, self.dtype, self.take = tensors, source, dtype, take

    def part(self, name: str, shape: tuple[int, ...]) -> Part:
        """The entry as stored: dense (in the state dict's dtype) or blocks."""
        if name not in self.tensors:
            raise ArtifactError(self.source, f"tensor missing, expected shape {shape}", name)
        tensor = self.tensors[name]
        if self.take:
            assert isinstance(self.tensors, MutableMapping)
            del self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ArtifactError(
                self.source, f"tensor has shape {tuple(tensor.shape)}, expected {shape}", name
            )
        return tensor if isinstance(tensor, BlockLinear) else tensor.to(self.dtype)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The entry as a dense tensor (blocks dequantised)."""
        return self.dense(self.part(name, shape))

    def dense(self, part: Part) -> torch.Tensor:
        return part.dequantize().to(self.dtype) if isinstance(part, BlockLinear) else part

    def linear(self, parts: list[Part], bias: torch.Tensor | None = None) -> Linear:
        """The row-wise concatenation of ``parts`` as one projection."""
        blocks = [part for part in parts if isinstance(part, BlockLinear)]
        if len(blocks) < len(parts):
            return DenseLinear(_cat([self.dense(part) for part in parts]), bias)
        runs: list[list[BlockLinear]] = []  # neighbours of one type fuse
        for part in blocks:
            if runs and runs[-1][0].kind == part.kind:
                runs[-1].append(part)
            else:
                runs.append([part])
        if len(runs) == 1:
            return BlockLinear.stack(runs[0], bias)
        return StackedBlocks(tuple(BlockLinear.stack(run) for run in runs), bias)


def _cat(rows: list[torch.Tensor]) -> torch.Tensor:
    # One part is used as it is: a tied head shares the embedding's storage.
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def build_weights(
    info: ModelInfo,
    tensors: Mapping[str, Part],
    source: str,
    dtype: torch.dtype = torch.float32,
    *,
    take: bool = False,
) -> LlamaWeights:
    """Assemble `LlamaWeights` from tensors named as in Hugging Face Llama/Qwen checkpoints.

    With ``take`` (``tensors`` then a mutable mapping the caller gives up), each entry is
    removed as it is used, so the parts of a fused projection are freed as soon as their
    concatenation exists, and the heap's freed pages go back to the system after each layer
    (``free`` alone leaves them resident between the fused copies): the build then holds
    one layer's copies at a time, not a second copy of every fused matrix."""
    sd = _StateDict(tensors, source, dtype, take)
    head_name = "lm_head.weight"
    tied = head_name not in tensors
    if tied and not info.tied_embeddings:
        raise ArtifactError(source, "untied model has no lm_head", head_name)
    table = sd.part("model.embed_tokens.weight", (info.vocab_size, info.dim))
    layers: list[LayerWeights] = []
    for i in range(info.n_layers):
        layers.append(_build_layer(info, sd, i))
        if take:
            trim_heap()
    norm = sd.get("model.norm.weight", (info.dim,))
    head = table if tied else sd.part(head_name, (info.vocab_size, info.dim))
    embed = BlockEmbedding(table) if isinstance(table, BlockLinear) else table
    return LlamaWeights(embed, tuple(layers), norm, sd.linear([head]), tied)


def _build_layer(info: ModelInfo, sd: _StateDict, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    q_out, kv_out, dim = info.n_heads * info.head_dim, info.kv_dim, info.dim
    q = sd.part(p + "self_attn.q_proj.weight", (q_out, dim))
    k = sd.part(p + "self_attn.k_proj.weight", (kv_out, dim))
    v = sd.part(p + "self_attn.v_proj.weight", (kv_out, dim))
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
    gate = sd.part(p + "mlp.gate_proj.weight", (info.ffn_dim, dim))
    up = sd.part(p + "mlp.up_proj.weight", (info.ffn_dim, dim))
    # Llama's norm before the MLP is named "post attention"; Gemma's "pre feedforward",
    # with its "post attention" norm on the attention's output.
    mlp_norm = "pre_feedforward_layernorm" if info.post_norms else "post_attention_layernorm"
    return LayerWeights(
        attn_norm=sd.get(p + "input_layernorm.weight", (dim,)),
        qkv=sd.linear([q, k, v], bias),
        q_norm=sd.get(p + "self_attn.q_norm.weight", qk_shape) if info.qk_norm else None,
        k_norm=sd.get(p + "self_attn.k_norm.weight", qk_shape) if info.qk_norm else None,
        o=sd.linear([sd.part(p + "self_attn.o_proj.weight", (dim, q_out))]),
        mlp_norm=sd.get(p + mlp_norm + ".weight", (dim,)),
        gate_up=sd.linear([gate, up]),
        down=sd.linear([sd.part(p + "mlp.down_proj.weight", (dim, info.ffn_dim))]),
        post_attn_norm=(
            sd.get(p + "post_attention_layernorm.weight", (dim,)) if info.post_norms else None
        ),
        post_mlp_norm=(
            sd.get(p + "post_feedforward_layernorm.weight", (dim,)) if info.post_norms else None
        ),
    )
