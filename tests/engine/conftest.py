"""Engine fixtures: tiny-model engines closed after each test, and a step recorder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import slotserve as ss
from slotserve.executor import TorchExecutor
from slotserve.kv import KVStore, StepBatch


class RecordingExecutor(TorchExecutor):
    """The real executor, also recording which sessions each step ran (and how many
    tokens each fed)."""

    def __init__(self, model: ss.Model) -> None:
        super().__init__(model)
        self.steps: list[list[tuple[int, int]]] = []

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        self.steps.append(list(zip(batch.sessions, batch.lengths, strict=True)))
        return super().step(tokens, batch, kv)


@pytest.fixture
def make_engine(tiny: ss.Model) -> Iterator[object]:
    engines: list[ss.Engine] = []

    def make(model: ss.Model | None = None, **config: object) -> ss.Engine:
        engine = ss.Engine(model or tiny, ss.EngineConfig(**config))  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
        engine.check_integrity()


def baseline(engine: ss.Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.slots_in_use, stats.kv_blocks_used
