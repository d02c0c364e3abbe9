"""The seam every executor shares: a model family as layer halves, and the one loop that
drives them.

A step is ``step = begin_step(context)``, ``x = embed(tokens)``, then for each layer
``x = out(i, x, kv.update_and_attend(i, qkv(i, x, step), batch), step)``, then
``end_step(step)``, then ``head(x)`` on the rows whose logits are wanted. ``context`` is the
`StepContext` every family reads (the step's rotation rows); ``step`` is what one kind of
halves makes of it once a step, of that kind's own type (its layers' kernel arguments,
rotation rows in the layout its methods read), typed by `LayerHalves`'s parameter.
``qkv`` returns one fused projection's rows ``[T, (heads + 2·kv_heads)·head_dim]`` (query
heads, then key heads, then value heads, RoPE applied), which the pool reads in place. The
KV cache is an argument, never a buffer of a half.

Implementations: `slotserve.model.llama.EagerHalves` (torch ops; every family),
`slotserve.model.block_forward.BlockHalves` (two fused C calls a layer, for the families
the block kernel covers) and a bundle's program methods (`slotserve.artifact.program`,
written for XNNPACK by `slotserve.export.program`; tests compare each with its eager
half). `slotserve.model.Model` holds one of them, picked once at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.store import CompiledAttention, KVStore
from slotserve.model.layers import RopeTables
from slotserve.model.weights import LlamaWeights

HalvesKind = Literal["eager", "block", "program"]
StepT = TypeVar("StepT")
StepT_contra = TypeVar("StepT_contra", contravariant=True)


@dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares, whatever the halves: the rotation rows of the
    step's positions (``cos``, ``sin``: ``[T, head_dim]`` contiguous fp32, rotate-half
    layout, which the C halves read by address; ``local_cos``, ``local_sin`` those of the
    sliding-window layers where their RoPE differs, as in Gemma 3). What one kind of
    halves needs beyond it, it makes in its ``begin_step`` (`LayerHalves`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    @classmethod
    def of(
        cls, rope: RopeTables, positions: torch.Tensor, local: RopeTables | None = None
    ) -> StepContext:
        """The context of a step at ``positions`` (one a row, on the flattened axis)."""
        cos, sin = (t.float().contiguous() for t in rope.rows(positions))
        if local is None:
            return cls(cos, sin)
        local_cos, local_sin = (t.float().contiguous() for t in local.rows(positions))
        return cls(cos, sin, local_cos, local_sin)

    def rotation(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of a layer: its own RoPE's if ``local`` and the model has one."""
        if local and self.local_cos is not None and self.local_sin is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    @property
    def rows(self) -> int:
        """The step's rows (tokens on the flattened axis)."""
        return self.cos.shape[0]


class LayerHalves(Protocol[StepT]):
    """A model family's layers cut at attention (see the module doc). ``weights`` are the
    loaded tensors (None for a program whose weights live in its own files);
    ``weight_bytes`` what the halves keep resident; ``max_step_tokens`` the largest step
    they take (None: any). A program's halves also have ``planned_method_bytes``, the
    arenas its methods plan, and ``mapped_weight_bytes``, the weights they use in place
    from a file map (0 for halves that hold their weights).

    ``StepT`` is the halves' own per-step object: `begin_step` makes it once at a step's
    start, every ``qkv`` and ``out`` of the step read it, and `end_step` ends it after the
    step's last layer (also when a layer raised). A model may be stepped from several
    threads at once (each with its own KV store): one step's object is never another's."""

    @property
    def kind(self) -> HalvesKind: ...

    @property
    def weights(self) -> LlamaWeights | None: ...

    @property
    def weight_bytes(self) -> int: ...

    @property
    def max_step_tokens(self) -> int | None: ...

    @property
    def planned_method_bytes(self) -> int: ...

    @property
    def mapped_weight_bytes(self) -> int: ...

    def begin_step(self, context: StepContext) -> StepT: ...

    def end_step(self, step: StepT) -> None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def qkv(self, layer: int, x: torch.Tensor, step: StepT) -> torch.Tensor: ...

    def out(self, layer: int, x: torch.Tensor, attn: torch.Tensor, step: StepT) -> torch.Tensor: ...

    def head(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class StackedHalves(Protocol[StepT_contra]):
    """Halves that can also run a step's layers in one call, the attention between them
    a `CompiledAttention` store's: ``stack`` runs them on ``x`` in place and says whether
    it did (False: the store had no compiled calls for this step; nothing ran)."""

    def stack(
        self, x: torch.Tensor, step: StepT_contra, batch: StepBatch, kv: CompiledAttention
    ) -> bool: ...


def run_layers(
    halves: LayerHalves[StepT],
    n_layers: int,
    rope: RopeTables,
    tokens: torch.Tensor,
    batch: StepBatch,
    kv: KVStore,
    local_rope: RopeTables | None = None,
) -> torch.Tensor:
    """The one loop: hidden states ``[T, dim]`` after the last layer (before the head).
    Halves and a store that can run it in C (`StackedHalves`, `CompiledAttention`) make
    the same calls there, in the same order."""
    step = halves.begin_step(StepContext.of(rope, batch.positions, local_rope))
    try:
        x = halves.embed(tokens)
        if isinstance(halves, StackedHalves) and isinstance(kv, CompiledAttention):  # noqa: SIM102
            if halves.stack(x, step, batch, kv):  # False: the loop below runs the step
                return x
        for layer in range(n_layers):
            attn = kv.update_and_attend(layer, halves.qkv(layer, x, step), batch)
            x = halves.out(layer, x, attn, step)
        return x
    finally:
        halves.end_step(step)
