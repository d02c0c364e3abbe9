"""Scenario ``layouts``: decode step time vs context length for each KV layout.

One session per layout grows through the context lengths: prefill up to the length, then
time single decode steps there (median and min–max over the steps).
"""

from __future__ import annotations

import time

import torch
from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.model import Model

CONTEXTS = (256, 1024, 2048)
PREFILL_CHUNK = 256


def layout_configs(max_context: int) -> dict[str, KVConfig]:
    return {
        "flat": KVConfig(layout="flat", max_seqs=1, max_context=max_context),
        "cell": KVConfig(layout="cell", max_seqs=1, max_context=max_context, block_size=16),
        "ring (window 1024)": KVConfig(
            layout="ring", max_seqs=1, max_context=max_context, ring_window=1024
        ),
    }


def _prefill_to(model: Model, pool: KVPool, target: int, gen: torch.Generator) -> None:
    while (start := pool.length(0)) < target:
        n = min(PREFILL_CHUNK, target - start)
        tokens = torch.randint(100, model.info.vocab_size, (n,), generator=gen)
        batch = StepBatch.single(start, n)
        pool.begin_step(batch)
        model.prefill(tokens, batch, pool)


def _step_times(model: Model, pool: KVPool, steps: int) -> list[float]:
    times = []
    token = torch.tensor([100])
    for _ in range(steps):
        start = time.perf_counter()
        batch = StepBatch.single(pool.length(0), 1)
        pool.begin_step(batch)  # inside the timing: the engine pays it every step too
        model.decode(token, batch, pool)
        times.append((time.perf_counter() - start) * 1000)
    return times


def run_layouts(model: Model, repeats: int = 5) -> dict[str, object]:
    steps = 4 * repeats
    limit = model.info.max_context - steps * len(CONTEXTS) - 16
    contexts = [c for c in CONTEXTS if c <= limit] or [limit // 4, limit // 2]
    max_context = max(contexts) + steps * len(contexts)
    max_context += -max_context % 16
    rows: dict[str, list[dict[str, object]]] = {}
    with Progress(transient=True) as progress:
        configs = layout_configs(max_context)
        task = progress.add_task("bench layouts", total=len(configs) * len(contexts))
        for name, config in configs.items():
            pool = KVPool(model.info, config, model.kernels.attention)
            pool.reserve(0, max_context)
            gen = torch.Generator().manual_seed(0)
            rows[name] = []
            for context in contexts:
                _prefill_to(model, pool, context, gen)
                _step_times(model, pool, 1)  # warm-up at this length
                times = _step_times(model, pool, steps)
                rows[name].append({"context": context, "step_ms": summary(times)})
                progress.advance(task)
    return {"steps_per_point": steps, "layouts": rows}
