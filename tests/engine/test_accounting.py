"""Honest accounting: a synthetic clock and executor drive the real engine, and the derived
TTFT, ITL, queue time and prefill throughput equal hand-computed values."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

import slotserve as ss
from slotserve.kv import KVStore, StepBatch

STEP_COST_PER_TOKEN = 0.010  # synthetic seconds a step takes per token it feeds


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now = round(self.now + seconds, 9)


class SyntheticExecutor:
    """Runs a step only when the test ticks; costs 10 ms per fed token; always predicts 7."""

    def __init__(self, clock: FakeClock, vocab: int) -> None:
        self.clock, self.vocab = clock, vocab
        self.gate = threading.Semaphore(0)

    def tick(self, steps: int) -> None:
        for _ in range(steps):
            self.gate.release()

    weight_bytes = 0  # weightless: it predicts a constant
    max_step_tokens = None  # any step size

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        assert self.gate.acquire(timeout=10), "test did not tick"
        self.clock.advance(STEP_COST_PER_TOKEN * len(tokens))
        logits = torch.zeros(batch.size, self.vocab)
        logits[:, 7] = 1.0
        return logits


def test_timings_equal_hand_computed_values(tiny: ss.Model) -> None:
    clock = FakeClock()
    executor = SyntheticExecutor(clock, tiny.info.vocab_size)
    config = ss.EngineConfig(max_seqs=1, max_context=64, prefill_chunk=4, queue_depth=1)
    engine = ss.Engine(tiny, config, executor=executor, clock=clock)
    try:
        params = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
        first = engine.submit(list(range(10, 20)), params)  # 10 prompt tokens, at t=0
        second = engine.submit([10, 11], params)  # queued behind it, at t=0
        executor.tick(3 + 2)  # first: prefill chunks 4+4+2, then 2 decodes
        a = first.result().timings
        executor.tick(1 + 2)  # second: one prefill chunk of 2, then 2 decodes
        b = second.result().timings
    finally:
        engine.close()
    # First: admitted at once; prefill ends at 0.10 s and samples the first token then.
    assert a.queue_time == 0.0
    assert a.first_scheduled == 0.0 and a.prefill_done == pytest.approx(0.10)
    assert a.ttft == pytest.approx(0.10)
    assert a.itl == pytest.approx([0.01, 0.01])
    assert a.tpot == pytest.approx(0.01)
    assert a.prompt_tokens_computed == 10 and a.prompt_tokens_restored == 0
    assert a.prefill_tok_s == pytest.approx(10 / 0.10)
    # Second: waited for the slot until the first ended at 0.12 s.
    assert b.queue_time == pytest.approx(0.12)
    assert b.prefill_time == pytest.approx(0.02)
    assert b.ttft == pytest.approx(0.14)  # from submit: queue 0.12 + prefill 0.02
    assert b.itl == pytest.approx([0.01, 0.01])
    assert b.prefill_tok_s == pytest.approx(2 / 0.02)


def test_cancel_latency_is_measured_to_the_release(tiny: ss.Model) -> None:
    clock = FakeClock()
    executor = SyntheticExecutor(clock, tiny.info.vocab_size)
    engine = ss.Engine(
        tiny, ss.EngineConfig(max_seqs=1, max_context=64), executor=executor, clock=clock
    )
    try:
        handle = engine.submit([10, 11], ss.SamplingParams(max_new_tokens=20, ignore_eos=True))
        executor.tick(2)
        events = iter(handle)
        next(events), next(events)
        clock.advance(0.5)  # the cancel comes 0.5 s after the second token
        cancelled_at = clock()
        handle.cancel()  # lands now: no step can move the clock before the next tick
        executor.tick(1)  # one more step may be in flight when the cancel lands
        ack = handle.cancel(wait=True)  # idempotent: the first cancel's time stands
        assert ack is not None
        final = handle.result()
        assert final.reason == "cancelled"
        assert final.timings.cancel_requested == cancelled_at
        assert 0.0 <= ack.latency_s <= STEP_COST_PER_TOKEN + 1e-9  # at most one step
    finally:
        engine.close()


def test_restoration_is_inside_the_prefill_span_and_only_computed_tokens_count(
    tiny: ss.Model,
) -> None:
    """A restored prefix: the prefill span starts before the restoration (here it costs a
    synthetic 0.05 s) and throughput divides computed tokens only by restore + compute."""
    clock = FakeClock()
    executor = SyntheticExecutor(clock, tiny.info.vocab_size)
    config = ss.EngineConfig(
        max_seqs=1, max_context=64, prefill_chunk=8, kv_layout="cell", block_size=4,
        prefix_cache_bytes="1MiB",
    )  # fmt: skip
    engine = ss.Engine(tiny, config, executor=executor, clock=clock)
    assert engine.prefix is not None
    bind = engine.prefix.bind

    def slow_bind(session: int, tokens: Sequence[int], n_tokens: int) -> int:
        clock.advance(0.05)  # the restoration's synthetic cost
        return bind(session, tokens, n_tokens)

    engine.prefix.bind = slow_bind  # type: ignore[method-assign]
    try:
        params = ss.SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        system = list(range(10, 22))  # 12 tokens
        first = engine.submit([*system, 30], params)  # at t=0; bind ends at 0.05
        executor.tick(2)  # chunks 8 + 5: 0.13 s
        a = first.result().timings
        second = engine.submit([*system, 31, 32], params)  # restores 12, computes 2
        executor.tick(1)
        b = second.result().timings
    finally:
        engine.close()
    assert a.prompt_tokens_restored == 0 and a.prompt_tokens_computed == 13
    assert a.prefill_time == pytest.approx(0.05 + 0.13)  # a miss's lookup counts, too
    started = b.restore_started
    assert started is not None and b.first_scheduled is not None
    assert b.prompt_tokens_restored == 12 and b.prompt_tokens_computed == 2
    assert b.restore_time == pytest.approx(0.05)
    assert b.first_scheduled - started == pytest.approx(0.05)
    assert b.prefill_time == pytest.approx(0.05 + 0.02)
    assert b.prefill_tok_s == pytest.approx(2 / 0.07)  # never 14 / 0.02
    assert b.ttft == pytest.approx(0.07)
