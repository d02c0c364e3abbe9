"""Per-token engine overhead on a bundle: the executor's step against the inter-token latency
of one greedy stream (what the engine adds: bookkeeping, sampling, event delivery).

    python tools/engine_overhead.py OUT/
"""

import statistics
import sys
import time

import slotserve as ss

model = ss.load(sys.argv[1])
engine = ss.Engine(model, ss.EngineConfig(max_seqs=1, max_context=256))
executor = engine._stepper.executor
step = executor.step
spent: list[float] = []


def timed(*args: object) -> object:
    began = time.perf_counter()
    logits = step(*args)
    spent.append(time.perf_counter() - began)
    return logits


executor.step = timed  # the engine calls the wrapped step
params = ss.SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
engine.submit(list(range(100, 132)), params).result()  # warm-up
spent.clear()
final = engine.submit(list(range(200, 232)), params).result()
engine.close()
step_ms = statistics.median(spent) * 1000
itl_ms = statistics.median(final.timings.itl) * 1000
print(f"{len(spent)} steps: executor.step median {step_ms:.1f} ms, ITL median {itl_ms:.1f} ms")
