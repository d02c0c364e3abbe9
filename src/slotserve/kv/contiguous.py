"""`ContiguousKV`: the simplest off-graph KV store, one contiguous row per slot.

Each slot owns ``max_context`` positions in every layer. The model never sees this class,
only its `update_and_attend`; the full pool (flat, ring and cell layouts) replaces it
behind the same method.
"""

from __future__ import annotations

import torch

from slotserve.errors import ContextOverflow
from slotserve.kv.attention import attend
from slotserve.kv.batch import StepBatch
from slotserve.model.info import ModelInfo


class ContiguousKV:
    """K/V storage ``[slots, max_context, kv_heads, head_dim]`` per layer, allocated once."""

    def __init__(
        self,
        info: ModelInfo,
        n_slots: int,
        max_context: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if n_slots < 1 or max_context < 1:
            raise ValueError(
                f"need n_slots >= 1 and max_context >= 1, got {n_slots}, {max_context}"
            )
        self.info, self.n_slots, self.max_context = info, n_slots, max_context
        shape = (n_slots, max_context, info.n_kv_heads, info.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(info.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(info.n_layers)]

    @property
    def nbytes(self) -> int:
        """Resident bytes of all K/V storage."""
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def check_capacity(self, batch: StepBatch) -> None:
        """Raise `ContextOverflow` (changing nothing) if the batch does not fit."""
        for slot, end in zip(batch.slots, batch.ends, strict=True):
            if not 0 <= slot < self.n_slots:
                raise ValueError(f"slot {slot} out of range 0..{self.n_slots - 1}")
            if end > self.max_context:
                raise ContextOverflow(end, self.max_context, "raise max_context or shorten input")

    def update_and_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """Write the step's ``k, v [T, kv_heads, head_dim]`` at the batch's positions, then
        attend the step's queries over each sequence's keys. Returns ``[T, heads*head_dim]``."""
        key_store, value_store = self.keys[layer], self.values[layer]
        key_store[batch.token_slots, batch.positions] = k.to(key_store.dtype)
        value_store[batch.token_slots, batch.positions] = v.to(value_store.dtype)
        key_len = max(batch.ends)
        if batch.size == 1:
            slot = batch.slots[0]
            keys = key_store[slot : slot + 1, :key_len]
            values = value_store[slot : slot + 1, :key_len]
        else:
            index = torch.tensor(batch.slots)
            keys = key_store[index, :key_len]
            values = value_store[index, :key_len]
        keys = keys.transpose(1, 2).to(q.dtype)
        values = values.transpose(1, 2).to(q.dtype)
        return attend(q, keys, values, batch, self.info.window(layer))
