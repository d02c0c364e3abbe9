"""The executor contract and its eager PyTorch implementation."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model import Model


class Executor(Protocol):
    """Runs one step: ``tokens[T]`` of ``batch`` over ``kv``; logits ``[B, vocab]`` of each
    sequence's last token. ``weight_bytes`` is what it keeps resident to do so (the engine's
    memory plan counts it); ``max_step_tokens`` the largest step it takes (None: any), which
    the engine's ``max_batch_tokens`` must not exceed."""

    @property
    def weight_bytes(self) -> int: ...

    @property
    def max_step_tokens(self) -> int | None: ...

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor: ...


class TorchExecutor:
    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def max_step_tokens(self) -> int | None:
        return None

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        return self.model.forward(tokens, batch, kv)


def executor_for(model: Model, **load_options: Any) -> Executor:
    """The executor that runs ``model``: eager torch for loaded weights; for a bundle's
    weightless model (`slotserve.load` of a bundle directory), the ExecuTorch runtime over
    its program, with ``load_options`` overriding the manifest's (`LoadOptions`)."""
    if model.weights is not None:
        return TorchExecutor(model)
    from slotserve.executor.executorch import ExecuTorchExecutor

    executor = ExecuTorchExecutor(model.source, **load_options)
    executor.model = model
    return executor
