"""`StepPlan`: what every layer of one step reads from the pool, built once a step.

`KVPool.begin_step` validates a step, un-shares the cell blocks it will write, builds its
plan and commits it; the plan then rides on the batch (``StepBatch.plan``) down to every
layer's `update_and_attend` and to `attention_calls`, which read it and never change it.
It holds, for each layer group of the pool (in ``pool.groups`` order), the cells the step
writes and the cells each query reads: a `PrefixPlan` (flat and cell layers), a
`RingPlan` (ring layers on torch ops) or a `RingKernelPlan` (ring layers on the compiled
kernel). It is a function of the batch and the sessions' block tables and slots at
`begin_step`, so building it there or at the first layer gives the same cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.kv.storage import KVStorage
from slotserve.native.attention import StepCells


@dataclass(frozen=True)
class PrefixPlan:
    """A flat or cell group's step: ``write[T]`` the cells of the new rows and
    ``gather[B, key_len]`` the cell of each sequence's positions (padding keys, past a
    sequence's end, point at its last real cell). On the compiled kernel, ``kernel`` holds
    them for C (made for ``heads`` query heads); on torch ops, ``causal`` says SDPA's
    causal kernel is exact and ``mask`` (None: none needed) hides what a query may not see."""

    write: torch.Tensor
    gather: torch.Tensor
    heads: int
    kernel: StepCells | None = None
    causal: bool = False
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class RingPlan:
    """A ring group's step on torch ops: ``old_cells[B, L]`` the ring cells of what each
    sequence kept before the step, ``mask`` the visibility of old keys then new ones, and
    ``rows`` of the step (sinks and the last ``window`` of each sequence) that stay in the
    ring, at cells ``write``."""

    old_cells: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    write: torch.Tensor


@dataclass(frozen=True)
class RingKernelPlan:
    """A ring group's step on the compiled kernel: ``kernel`` (for ``heads`` query heads)
    reads the step's own rows from ``buffers`` (K and V of the storage's dtype, one row a
    step row, shared by the group's layers), then ``rows`` of them are copied into ring
    cells ``to``."""

    kernel: StepCells
    heads: int
    buffers: tuple[KVStorage, KVStorage]
    rows: torch.Tensor
    to: torch.Tensor


GroupPlan = PrefixPlan | RingPlan | RingKernelPlan


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's plan in the pool ``owner`` (the pool that began it): one `GroupPlan` for
    each of its layer groups, in ``owner.groups`` order."""

    owner: object
    groups: tuple[GroupPlan, ...]
