"""`TimedExecutor`: the runner's executor, which times every forward pass into the running
generation's `Stats` (ExecuTorch's model-execution fields).

Owns: the forward windows, nothing else. The engine calls ``step`` on its own thread; the
runner names the `Stats` to fill (``timing``) before it submits a generation and clears it
once the generation has ended (its `Finished` comes after its last step), so a window is
written only while exactly one generation runs. Its engine has one slot, so every step is
that generation's. Must not touch: the step itself (the logits are the model's).
"""

from __future__ import annotations

import torch

from slotserve.executor import TorchExecutor
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.runner.result import Stats


class TimedExecutor(TorchExecutor):
    """`TorchExecutor` whose every ``step`` is a model-execution window of ``timing``
    (`Stats.on_model_execution_begin`/``end``); no window while ``timing`` is None (the
    engine's start-up probes)."""

    timing: Stats | None = None

    def step(
        self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        stats = self.timing
        if stats is None:
            return super().step(tokens, batch, kv, all_logits=all_logits)
        stats.on_model_execution_begin()
        try:
            return super().step(tokens, batch, kv, all_logits=all_logits)
        finally:
            stats.on_model_execution_end()
