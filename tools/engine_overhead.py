"""Per-token engine overhead on a bundle: the executor's step against the inter-token latency
of one greedy stream (what the engine adds: bookkeeping, sampling, event delivery).

    python tools/engine_overhead.py OUT/
"""

import statistics
import sys
import time

import torch

import slotserve as ss
from slotserve.executor import executor_for
from slotserve.kv import KVStore, StepBatch


class TimedExecutor:
    """The model's own executor, recording how long each step takes."""

    def __init__(self, model: ss.Model) -> None:
        self.inner = executor_for(model)
        self.weight_bytes = self.inner.weight_bytes
        self.max_step_tokens = self.inner.max_step_tokens
        self.seconds: list[float] = []

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        began = time.perf_counter()
        logits = self.inner.step(tokens, batch, kv)
        self.seconds.append(time.perf_counter() - began)
        return logits


model = ss.load(sys.argv[1])
executor = TimedExecutor(model)
params = ss.SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
with ss.Engine(model, ss.EngineConfig(max_seqs=1, max_context=256), executor=executor) as engine:
    engine.submit(list(range(100, 132)), params).result()  # warm-up
    executor.seconds.clear()
    final = engine.submit(list(range(200, 232)), params).result()
step_ms = statistics.median(executor.seconds) * 1000
itl_ms = statistics.median(final.timings.itl) * 1000
steps = len(executor.seconds)
print(f"{steps} steps: executor.step median {step_ms:.1f} ms, ITL median {itl_ms:.1f} ms")
