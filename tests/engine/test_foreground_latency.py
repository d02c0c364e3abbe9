"""The design's third failure mode, as a test that can fail: a foreground request's
inter-token latency while a long background job is in flight. On the synthetic clock (each
step costs 10 ms a token it feeds, `tests.engine.test_accounting`), ``isolate`` keeps the
foreground's median ITL within 1.15x of its ITL alone; ``fifo`` co-batches the job's
prefill chunks and decodes into the foreground's steps and does not.
"""

from __future__ import annotations

import statistics
import time

import pytest

import slotserve as ss
from tests.engine.test_accounting import STEP_COST_PER_TOKEN, FakeClock, SyntheticExecutor

FOREGROUND = ss.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
BACKGROUND = ss.SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


def foreground_itl(tiny: ss.Model, policy: str, with_background: bool) -> list[float]:
    clock = FakeClock()
    executor = SyntheticExecutor(clock, tiny.info.vocab_size)
    config = ss.EngineConfig(
        max_seqs=2, max_context=256, kv_layout="cell", policy=policy, prefill_chunk=32
    )
    engine = ss.Engine(tiny, config, executor=executor, clock=clock)
    try:
        job = None
        if with_background:
            # 200 prompt tokens: 7 prefill chunks of 32, then 40 decodes.
            job = engine.submit(list(range(10, 210)), BACKGROUND, priority="background")
            executor.tick(2)  # the job is two chunks into its prefill...
            deadline = time.monotonic() + 10
            while engine.stats().steps < 2:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        turn = engine.submit(list(range(20, 44)), FOREGROUND, priority="interactive")
        executor.tick(1000)  # ...when the foreground turn arrives; every step may run now
        itl = turn.result().timings.itl
        if job is not None:
            assert job.result().reason == "length"  # the job ran to its end, never starved
        return itl
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["isolate", "fifo"])
def test_foreground_itl_beside_a_long_background_job(tiny: ss.Model, policy: str) -> None:
    alone = foreground_itl(tiny, policy, with_background=False)
    assert alone == pytest.approx([STEP_COST_PER_TOKEN] * 15)  # one-token decode steps
    beside = foreground_itl(tiny, policy, with_background=True)
    ratio = statistics.median(beside) / statistics.median(alone)
    if policy == "isolate":
        assert ratio <= 1.15, beside
        # The job still advanced: some gaps hold one of its steps (its minimum share).
        assert max(beside) > 2 * STEP_COST_PER_TOKEN
    else:
        assert ratio > 1.15, beside
