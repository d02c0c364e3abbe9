"""`TorchExecutor`: a loaded model's steps through its layer halves; `executor_for`."""

from __future__ import annotations

import torch

from slotserve.executor.base import Executor
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model import Model


class TorchExecutor:
    """Runs ``model.forward``: the one loop over whichever halves the model was loaded with
    (eager torch ops, the fused block kernels, or a bundle's program methods on the
    ExecuTorch runtime, `slotserve.artifact.program`). What it keeps resident and the
    largest step it takes are the halves'."""

    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def max_step_tokens(self) -> int | None:
        return self.model.halves.max_step_tokens

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        return self.model.forward(tokens, batch, kv)


def executor_for(model: Model) -> Executor:
    """The executor that runs ``model``, whatever its halves (a bundle's included: its
    program was loaded, checked and sized by `slotserve.load`)."""
    return TorchExecutor(model)
