"""`LockedKV`: the pool as the engine thread's model sees it.

Callers on other threads bind and release sessions under the engine lock while a step
runs; the step's own pool mutation (`begin_step`: commit lengths, copy-on-write) takes the
same lock. Attention reads only the bindings of the step's sessions, which nothing else
changes while the step runs.
"""

from __future__ import annotations

import threading

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.pool import KVPool


class LockedKV:
    def __init__(self, pool: KVPool, lock: threading.Condition) -> None:
        self.pool, self.lock = pool, lock

    def begin_step(self, batch: StepBatch) -> None:
        with self.lock:
            self.pool.begin_step(batch)

    def update_and_attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        return self.pool.update_and_attend(layer, q, k, v, batch)
