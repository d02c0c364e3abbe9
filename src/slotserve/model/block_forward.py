"""The fused halves on GGUF block weights: per layer, one kernel call before the attention
(RMSNorm, the fused Q/K/V product, q/k norms, RoPE) and one after it (the output product,
its norm and residual, RMSNorm, gate/up, SwiGLU or GELU, down, its norm and residual), for
the Llama, Qwen3 and Gemma 3 layers.

They compute what `slotserve.model.llama.EagerHalves` computes on the same weights (the
same block products, norms and rotations); they only leave out the dozens of small torch
calls per layer that would otherwise cost as much as the products at decode time.
`BlockHalves.refusal` says why a model is not covered (then it runs the eager halves, on
the same blocks).

A step's object (`BlockStep`) holds the kernel arguments of every layer over buffers of the
step's rows, which the step holds alone from `BlockHalves.begin_step` to
`BlockHalves.end_step`; small steps take them from the halves' kept calls (`_KeptCalls`)
and give them back, so a decode step builds none.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from slotserve.info import ModelInfo
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import CompiledAttention
from slotserve.model.gguf_linear import BlockLinear, StackedBlocks
from slotserve.model.halves import HalvesKind, StepContext
from slotserve.model.llama import LoadedHalves
from slotserve.model.weights import LlamaWeights
from slotserve.native.blocks import (
    BlockKernel,
    LayerInArgs,
    LayerOutArgs,
    Matrix,
    ScratchSpace,
    StackArgs,
)


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None


class _StepBuffers:
    """One step's outputs and work space, shared by its layers."""

    def __init__(self, m: int, info: ModelInfo) -> None:
        attn_width = info.n_heads * info.head_dim
        self.qkv = torch.empty(m, (info.n_heads + 2 * info.n_kv_heads) * info.head_dim)
        self.gate_up = torch.empty(m, 2 * info.ffn_dim)
        self.attn = torch.empty(m, attn_width)  # the attention's rows, in a stack (`stack`)
        self.scratch = ScratchSpace(m, max(info.dim, info.ffn_dim, attn_width))


# Steps of at most this many rows (decode steps, short turns) reuse their buffers and every
# layer's kernel arguments from one step to the next, and set only their addresses: the
# Python between a step's kernel calls runs with the caches the weights just flushed, so
# rebuilding the arguments each step is a visible share of a decode step. Larger steps
# (prompt chunks) build their own; so the buffers kept between steps stay small.
REUSED_ROWS = 64
# How many small steps' calls are kept between steps, the most recently ended: one serves
# a model stepped at one size by one thread; two also serve a model whose steps alternate
# between two sizes, or that two threads step at once, without building any.
KEPT_CALLS = 2


class _LayerCalls:
    """The buffers of steps of ``m`` rows and each layer's `LayerInArgs` and `LayerOutArgs`
    over them; a step sets only its own addresses (residual rows, rotation rows, the
    attention's output) and the thread count."""

    def __init__(self, halves: BlockHalves, m: int) -> None:
        info, kernel = halves.info, halves.kernel
        self.m, self.buffers = m, _StepBuffers(m, info)
        self.ins = [self._in(info, layer, kernel.threads) for layer in halves.layers]
        self.outs = [self._out(info, layer, kernel.threads) for layer in halves.layers]
        self.local = [info.local_rope(layer) for layer in range(info.n_layers)]
        # For `BlockHalves.stack`: the layers' arguments by address (the attention's are the
        # store's, set each step).
        self._ins_at, self._outs_at = _addresses(self.ins), _addresses(self.outs)
        self.stack = StackArgs(
            len(self.ins),
            ctypes.addressof(self._ins_at),
            None,
            ctypes.addressof(self._outs_at),
            None,
        )

    def _in(self, info: ModelInfo, layer: _Layer, threads: int) -> LayerInArgs:
        buffers = self.buffers
        return LayerInArgs(
            None, self.m, info.dim, layer.attn_norm.data_ptr(), info.norm_eps, layer.qkv,
            buffers.qkv.data_ptr(), info.n_heads + info.n_kv_heads, info.head_dim, None, None,
            _address(layer.q_norm), _address(layer.k_norm), info.n_heads,
            buffers.scratch.struct, threads,
        )  # fmt: skip

    def _out(self, info: ModelInfo, layer: _Layer, threads: int) -> LayerOutArgs:
        buffers = self.buffers
        return LayerOutArgs(
            None, self.m, info.dim, None, info.n_heads * info.head_dim, layer.o,
            layer.mlp_norm.data_ptr(), info.norm_eps, layer.gate_up, buffers.gate_up.data_ptr(),
            layer.down, _address(layer.post_attn_norm), _address(layer.post_mlp_norm),
            int(info.activation == "gelu_tanh"), buffers.scratch.struct, threads,
        )  # fmt: skip


class _KeptCalls:
    """The `_LayerCalls` of small steps (`REUSED_ROWS` rows at most) kept between steps,
    at most `KEPT_CALLS` of them, the most recently given back.

    Ownership: a step takes calls of its row count at its start (`take`; None: none kept,
    the step builds its own) and holds them alone until its end (`give_back`), so steps
    that run at once (one model stepped by two threads, each with its own KV store) never
    share buffers or arguments. Thread-safety: every thread that steps the model calls
    both; a lock guards the list, held for a list operation, never across a kernel call."""

    def __init__(self) -> None:
        self._kept: list[_LayerCalls] = []
        self._lock = threading.Lock()

    def take(self, m: int) -> _LayerCalls | None:
        """Kept calls for steps of ``m`` rows, now the caller's (None: none kept)."""
        with self._lock:
            for i in range(len(self._kept) - 1, -1, -1):
                if self._kept[i].m == m:
                    return self._kept.pop(i)
        return None

    def give_back(self, calls: _LayerCalls) -> None:
        """Keep ``calls``, which their step no longer uses, dropping the least recently
        given back beyond `KEPT_CALLS`."""
        with self._lock:
            self._kept.append(calls)
            del self._kept[:-KEPT_CALLS]


@dataclass(frozen=True, eq=False, slots=True)
class BlockStep:
    """One step of `BlockHalves`: its ``context`` (rotation rows) and ``calls``, the layers'
    kernel arguments over buffers of the step's rows, held by this step alone."""

    context: StepContext
    calls: _LayerCalls


class BlockHalves(LoadedHalves):
    """The eager halves (`slotserve.model.llama.EagerHalves`) with ``qkv``, ``out`` and the
    head's norm as kernel calls, on the same weights (`LoadedHalves`). Any thread may step
    them, several at once (`_KeptCalls` says who holds what)."""

    def __init__(self, weights: LlamaWeights, info: ModelInfo, kernel: BlockKernel) -> None:
        if (reason := self.refusal(weights, info)) is not None:
            raise ValueError(f"the fused block halves do not cover this model: {reason}")
        super().__init__(weights, info)
        self.kernel = kernel
        self.layers = tuple(
            _Layer(
                _floats(layer.attn_norm),
                _floats(layer.mlp_norm),
                _matrix(layer.qkv),
                _matrix(layer.o),
                _matrix(layer.gate_up),
                _matrix(layer.down),
                _maybe_floats(layer.q_norm),
                _maybe_floats(layer.k_norm),
                _maybe_floats(layer.post_attn_norm),
                _maybe_floats(layer.post_mlp_norm),
            )
            for layer in weights.layers
        )
        self.final_norm = _floats(weights.norm)
        self._kept = _KeptCalls()

    @staticmethod
    def refusal(weights: LlamaWeights, info: ModelInfo) -> str | None:
        """Why these halves cannot run ``weights`` (None: they can)."""
        for layer in weights.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if not isinstance(linear, (BlockLinear, StackedBlocks)):
                    return "projections that are not all GGUF blocks"
                if linear.bias is not None:
                    return "projection biases"
        return None

    @property
    def kind(self) -> HalvesKind:
        return "block"

    def begin_step(self, context: StepContext) -> BlockStep:
        """The step's layer calls: kept ones of its size for a small step (`REUSED_ROWS`),
        else built for it."""
        m = context.rows
        calls = self._kept.take(m) if m <= REUSED_ROWS else None
        return BlockStep(context, calls if calls is not None else _LayerCalls(self, m))

    def end_step(self, step: BlockStep) -> None:
        """Keep a small step's calls for the next step of its size (`_KeptCalls`)."""
        if step.calls.m <= REUSED_ROWS:
            self._kept.give_back(step.calls)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self._weights.embed[tokens].float()
        if self.info.embed_scale != 1.0:
            rows = rows * self.info.embed_scale
        return rows.contiguous()

    def qkv(self, layer: int, x: torch.Tensor, step: BlockStep) -> torch.Tensor:
        calls = step.calls
        cos, sin = step.context.rotation(self.info.local_rope(layer))
        args = calls.ins[layer]
        args.x, args.cos, args.sin = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        args.threads = self.kernel.threads
        self.kernel.layer_in(args)
        return calls.buffers.qkv

    def out(self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: BlockStep) -> torch.Tensor:
        calls = step.calls
        if attn.dtype != torch.float32 or not attn.is_contiguous():
            attn = attn.float().contiguous()
        args = calls.outs[layer]
        args.x, args.attn, args.threads = x.data_ptr(), attn.data_ptr(), self.kernel.threads
        self.kernel.layer_out(args)  # in place
        return x

    def stack(
        self, x: torch.Tensor, step: BlockStep, batch: StepBatch, kv: CompiledAttention
    ) -> bool:
        """Every layer of the step in one kernel call (`BlockKernel.layer_stack`): the calls
        `qkv`, ``kv.update_and_attend`` and `out` make one by one, on ``x`` in place (fp32,
        contiguous: `embed`'s rows). False, having run nothing, where ``kv`` has no compiled
        calls for this step (`CompiledAttention`)."""
        calls = step.calls
        buffers = calls.buffers
        attention = kv.attention_calls(batch, buffers.qkv, self.info.n_heads, buffers.attn)
        if attention is None:
            return False
        threads, at, attn = self.kernel.threads, x.data_ptr(), buffers.attn.data_ptr()
        rotations = {
            local: tuple(t.data_ptr() for t in step.context.rotation(local))
            for local in (False, True)
        }
        for ins, outs, local in zip(calls.ins, calls.outs, calls.local, strict=True):
            ins.x, (ins.cos, ins.sin), ins.threads = at, rotations[local], threads
            outs.x, outs.attn, outs.threads = at, attn, threads
        calls.stack.attends = ctypes.addressof(attention.args)
        calls.stack.attend = attention.function
        self.kernel.layer_stack(calls.stack)
        return True

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm in the kernel (row by row, as the layers' norms), then the head."""
        norm = self.kernel.rms_norm(x, self.final_norm, self.info.norm_eps)
        return self.weights.lm_head(norm)


def _matrix(linear: object) -> Matrix:
    if isinstance(linear, StackedBlocks):
        return Matrix.chain([(part.packed, part.kind) for part in linear.parts])
    assert isinstance(linear, BlockLinear)  # refusal() ran
    return Matrix.of(linear.packed, linear.kind)


def _floats(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().contiguous()


def _maybe_floats(weight: torch.Tensor | None) -> torch.Tensor | None:
    return _floats(weight) if weight is not None else None


def _addresses(structs: list[LayerInArgs] | list[LayerOutArgs]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(structs))(*(ctypes.addressof(s) for s in structs))


def _address(weight: torch.Tensor | None) -> int | None:
    return weight.data_ptr() if weight is not None else None
