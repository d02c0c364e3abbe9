"""The narrow contract between the model and any KV layout."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from slotserve.kv.batch import StepBatch
from slotserve.native.attention import AttentionCalls


class KVStore(Protocol):
    """What the model may ask of the KV cache: nothing but ``update_and_attend`` (and, of a
    store that can, the same calls compiled: `CompiledAttention`).

    ``qkv[T, (heads + 2·kv_heads)·head_dim]`` are one fused projection's rows (the query
    heads, then the key heads, then the value heads, RoPE applied), as every layer half
    returns them. Implementations write the K/V rows at the positions the batch names and
    return attention of the queries over each sequence's visible keys as
    ``[T, heads * head_dim]``; a layout may read the rows in place. They own all storage;
    the model keeps none between calls. The step was validated and committed before the
    model runs (`KVPool.begin_step`, by whoever drives the pool: the engine), so a model or
    an executor never does the pool's bookkeeping.
    """

    def update_and_attend(
        self, layer: int, qkv: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor: ...


@runtime_checkable
class CompiledAttention(Protocol):
    """A store that can hand a step's attention, every layer's, to a caller that runs the
    step's layers in C (`slotserve.model.block_forward.BlockHalves.stack`): the calls its
    ``update_and_attend`` would make, each reading the layer's fused rows from ``qkv`` and
    writing ``out[T, heads * head_dim]``, or None where it cannot for this step."""

    def attention_calls(
        self, batch: StepBatch, qkv: torch.Tensor, heads: int, out: torch.Tensor
    ) -> AttentionCalls | None: ...
