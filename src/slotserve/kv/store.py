"""The narrow contract between the model and any KV layout."""

from __future__ import annotations

from typing import Protocol

import torch

from slotserve.kv.batch import StepBatch


class KVStore(Protocol):
    """What the model may ask of the KV cache: nothing but ``update_and_attend`` (or the same
    on one fused projection's rows, ``update_and_attend_rows``).

    Implementations write ``k``/``v`` (``[T, kv_heads, head_dim]``, RoPE applied) at the
    positions the batch names and return attention of ``q`` (``[T, heads, head_dim]``)
    over each sequence's visible keys as ``[T, heads * head_dim]``. They own all storage;
    the model keeps none between calls. The step was validated and committed before the
    model runs (`KVPool.begin_step`, by whoever drives the pool: the engine), so a model or
    an executor never does the pool's bookkeeping.
    """

    def update_and_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor: ...

    def update_and_attend_rows(
        self, layer: int, qkv: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """`update_and_attend` for ``qkv[T, (heads + 2·kv_heads)·head_dim]``, the rows of one
        fused projection (query heads, then key heads, then value heads), as an exported
        program returns them: a layout may read them in place without making views."""
        ...
