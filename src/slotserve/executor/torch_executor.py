"""The executor contract and its eager PyTorch implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model import Model


class Executor(Protocol):
    """Runs one step: ``tokens[T]`` of ``batch`` over ``kv``; logits ``[B, vocab]`` of each
    sequence's last token. ``weight_bytes`` is what it keeps resident to do so (the engine's
    memory plan counts it)."""

    @property
    def weight_bytes(self) -> int: ...

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor: ...


class TorchExecutor:
    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        return self.model.forward(tokens, batch, kv)
