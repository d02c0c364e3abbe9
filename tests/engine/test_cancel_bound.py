"""Bounded cancellation has a declared bound: a cancel waits at most for the step in flight,
and the engine states the worst case, from the largest step its config allows and the
step times it measured, beside the measured cancel→release p99.

The synthetic clock and executor (`tests.engine.test_accounting`: 10 ms a fed token) make
every figure exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import slotserve as ss
from slotserve.engine.cancel_bound import (
    CancelBound,
    declare_cancel_bound,
    largest_step_tokens,
)
from slotserve.engine.probe import measure_cancel_bound
from slotserve.executor import executor_for
from slotserve.kv import KVStore, StepBatch
from slotserve.memory import MemoryLedger
from tests.engine.test_accounting import STEP_COST_PER_TOKEN, FakeClock, SyntheticExecutor

PARAMS = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


class SignallingExecutor(SyntheticExecutor):
    """The synthetic executor that also says when a step has begun (is waiting for a tick)."""

    def __init__(self, clock: FakeClock, vocab: int) -> None:
        super().__init__(clock, vocab)
        self.entered = threading.Semaphore(0)

    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        self.entered.release()
        return super().step(tokens, batch, kv)


def synthetic_engine(
    tiny: ss.Model, **config: object
) -> tuple[ss.Engine, SignallingExecutor, FakeClock]:
    clock = FakeClock()
    executor = SignallingExecutor(clock, tiny.info.vocab_size)
    engine = ss.Engine(tiny, ss.EngineConfig(**config), executor=executor, clock=clock)  # type: ignore[arg-type]
    return engine, executor, clock


def test_the_largest_step_is_what_the_config_allows() -> None:
    assert largest_step_tokens(ss.EngineConfig()) == 512  # max_batch_tokens
    # One sequence feeds at most one prefill chunk a step.
    assert largest_step_tokens(ss.EngineConfig(max_seqs=1)) == 256
    assert largest_step_tokens(ss.EngineConfig(max_seqs=2, prefill_chunk=64)) == 128
    assert largest_step_tokens(ss.EngineConfig(max_seqs=4, max_batch_tokens=64)) == 64


def test_the_bound_is_the_largest_steps_measured_time(tiny: ss.Model) -> None:
    engine, executor, _ = synthetic_engine(
        tiny, max_seqs=1, max_context=256, prefill_chunk=64, max_batch_tokens=64
    )
    try:
        bound = engine.cancel_bound()
        assert (bound.max_step_tokens, bound.estimate_s, bound.basis) == (64, None, "unmeasured")
        handle = engine.submit(list(range(10, 140)), PARAMS)  # 130 tokens: chunks 64, 64, 2
        executor.tick(3 + 2)
        handle.result()
        bound = engine.cancel_bound()
    finally:
        engine.close()
    assert bound.basis == "measured" and bound.max_step_tokens == 64
    assert bound.estimate_s == pytest.approx(64 * STEP_COST_PER_TOKEN)
    assert bound.measured_p99_s is None and bound.cancels_measured == 0  # nothing cancelled


def test_a_bound_beyond_the_measured_steps_is_extrapolated(tiny: ss.Model) -> None:
    engine, executor, _ = synthetic_engine(
        tiny, max_seqs=1, max_context=256, prefill_chunk=64, max_batch_tokens=64
    )
    try:
        handle = engine.submit(list(range(10, 20)), PARAMS)  # a 10-token step, then decodes
        executor.tick(3)
        handle.result()
        bound = engine.cancel_bound()
    finally:
        engine.close()
    # Step time = 0 + 0.01 s a token over the measured sizes (1 and 10): 0.64 s at 64.
    assert bound.basis == "extrapolated"
    assert bound.estimate_s == pytest.approx(64 * STEP_COST_PER_TOKEN)


def test_one_measured_size_is_scaled_without_a_fixed_cost() -> None:
    bound = declare_cancel_bound(64, {1: [0.01, 0.012]}, [])
    assert bound.basis == "proportional"  # an upper estimate: no fixed cost assumed
    assert bound.estimate_s == pytest.approx(64 * 0.012)


def test_a_cancel_is_released_within_the_declared_bound_and_its_p99_is_kept(
    tiny: ss.Model,
) -> None:
    """The worst case: the cancel lands just as the largest step begins. It is released at
    the end of that step, within the bound, and the measured figure is kept beside it."""
    engine, executor, clock = synthetic_engine(
        tiny, max_seqs=1, max_context=256, prefill_chunk=64, max_batch_tokens=64
    )
    try:
        handle = engine.submit(list(range(10, 210)), PARAMS)  # 200 tokens: a 64-token step
        assert executor.entered.acquire(timeout=10)  # the largest step has begun
        cancelled_at = clock()
        handle.cancel()
        executor.tick(1)
        ack = handle.cancel(wait=True)
        assert ack is not None and handle.result().timings.cancel_requested == cancelled_at
        stats = engine.stats()
    finally:
        engine.close()
    bound = stats.cancel_bound
    assert isinstance(bound, CancelBound)
    assert ack.latency_s == pytest.approx(64 * STEP_COST_PER_TOKEN)
    assert bound.estimate_s is not None and ack.latency_s <= bound.estimate_s + 1e-9
    assert bound.measured_p99_s == pytest.approx(ack.latency_s)
    assert bound.measured_max_s == pytest.approx(ack.latency_s)
    assert bound.cancels_measured == 1
    assert bound.to_dict() == {
        "max_step_tokens": 64,
        "estimate_s": pytest.approx(0.64),
        "basis": "measured",
        "measured_p99_s": pytest.approx(0.64),
        "measured_max_s": pytest.approx(0.64),
        "cancels_measured": 1,
    }


def test_capping_the_step_caps_the_bound(tiny: ss.Model) -> None:
    """The same prompt under the default step and under a 32-token cap: the declared worst
    case shrinks with the cap (a long prompt is prefilled in more, smaller steps)."""
    bounds = {}
    for cap in (128, 32):
        engine, executor, _ = synthetic_engine(
            tiny, max_seqs=1, max_context=256, prefill_chunk=256, max_batch_tokens=cap
        )
        try:
            handle = engine.submit(list(range(10, 250)), PARAMS)  # 240 tokens
            executor.tick(-(-240 // cap) + 2)
            handle.result()
            bounds[cap] = engine.cancel_bound()
        finally:
            engine.close()
    assert bounds[128].estimate_s == pytest.approx(128 * STEP_COST_PER_TOKEN)
    assert bounds[32].estimate_s == pytest.approx(32 * STEP_COST_PER_TOKEN)


def test_the_voice_preset_caps_its_step_for_barge_in(tiny: ss.Model) -> None:
    from slotserve.engine.presets import choose_preset

    voice = choose_preset("voice", tiny, None)
    assert voice.config.max_batch_tokens == 64 and largest_step_tokens(voice.config) == 64
    decision = next(d for d in voice.decisions if d.setting == "max_batch_tokens")
    assert decision.source == "preset" and "cancel" in decision.why
    chat = choose_preset("chat", tiny, None)
    assert chat.config.max_batch_tokens == ss.EngineConfig().max_batch_tokens
    assert next(d for d in chat.decisions if d.setting == "max_batch_tokens").source == "default"


def test_the_bound_can_be_measured_before_serving(tiny: ss.Model) -> None:
    """What `plan --measure` states: the model's own step of the largest size, timed."""
    config = ss.EngineConfig(max_seqs=2, max_context=128, max_batch_tokens=48, prefill_chunk=48)
    bound = measure_cancel_bound(tiny, config, executor_for(tiny))
    assert bound.basis == "measured" and bound.max_step_tokens == 48
    assert bound.estimate_s is not None and 0 < bound.estimate_s < 5
    assert "48-token step" in bound.describe()


@pytest.mark.parametrize("layout", ["flat", "cell"])
def test_the_bound_is_measured_before_serving_on_the_engines_own_pool(
    tiny: ss.Model, layout: str
) -> None:
    """`Engine.measure_cancel_bound` (serve calls it at start): the largest step, every
    session at max_context, timed on the engine's own pool; afterwards the pool holds
    nothing and counts no step, and requests run as before."""
    config = ss.EngineConfig(kv_layout=layout, max_seqs=2, max_context=96, prefill_chunk=32)
    with ss.Engine(tiny, config) as engine:
        assert engine.cancel_bound().basis == "unmeasured"
        bound = engine.measure_cancel_bound()
        assert (bound.max_step_tokens, bound.basis) == (64, "measured")
        assert bound.estimate_s is not None and bound.estimate_s > 0
        engine.check_integrity()
        stats = engine.stats()
        assert (stats.slots_in_use, stats.kv_blocks_used, stats.steps) == (0, 0, 0)
        final = engine.submit(list(range(10, 40)), PARAMS).result()
        assert final.reason == "length"
        engine.check_integrity()


def _fake_readings(
    monkeypatch: pytest.MonkeyPatch, kept: int, written: Callable[[], int] = lambda: 0
) -> None:
    """The ledger's meters read 100 MiB of anonymous memory, ``kept`` more from their
    second reading on, and the KV pages ``written()`` says."""
    import slotserve.memory.ledger as ledger_module
    from slotserve.memory import Reading

    calls: list[int] = []

    def read(pid: int | None = None) -> Reading:
        calls.append(1)
        now = 100 * 2**20 + (kept if len(calls) > 1 else 0) + written()
        return Reading(now, now, 0, 0, now)

    monkeypatch.setattr(ledger_module, "read_process", read)


def test_what_the_start_step_keeps_joins_the_process_start_arena(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step `measure_cancel_bound` runs leaves one-time state: within a process budget
    it joins the ledger's start arena (a model budget leaves it out), within the reserve a
    command set aside for it, and a budget it no longer fits refuses with `PlanError`."""
    for scope, grown in (("process", 3 * 2**20), ("model", 0)):
        config = ss.EngineConfig(max_seqs=2, max_context=96, budget_scope=scope)
        with ss.Engine(tiny, config) as engine, monkeypatch.context() as patch:
            _fake_readings(patch, 3 * 2**20)
            before = engine.ledger.total  # the model's ledger: earlier engines' arenas too
            engine.measure_cancel_bound()
            assert engine.ledger.total - before == grown, scope
    reserved = MemoryLedger()
    reserved.add("start", 4 * 2**20, "reserved", "the test: serve's reserve")
    config = ss.EngineConfig(max_seqs=2, max_context=96, budget_scope="process")
    with ss.Engine(tiny, config, ledger=reserved) as engine, monkeypatch.context() as patch:
        _fake_readings(patch, 3 * 2**20)
        before = engine.ledger.total
        engine.measure_cancel_bound()
        assert engine.ledger.total == before  # measured within the reserve
        assert engine.ledger.has("start", "the largest step")
    tight = ss.EngineConfig(max_seqs=2, max_context=96, budget_scope="process")
    with ss.Engine(tiny, tight) as engine:
        budget = engine.plan.required_bytes + 2**20  # fits now, not with 300 MiB more
    config = ss.EngineConfig(
        max_seqs=2, max_context=96, budget_scope="process", memory_budget=str(budget)
    )
    with ss.Engine(tiny, config) as engine, monkeypatch.context() as patch:
        _fake_readings(patch, 300 * 2**20)
        with pytest.raises(ss.PlanError):
            engine.measure_cancel_bound()


def test_the_kv_the_start_step_writes_counts_in_the_pool_not_the_start_arena(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start step writes KV pages of the engine's own pool (the plan's kv arena): only
    what it keeps beyond them joins the start arena. They were counted in both."""
    # 4 x 256 cells: storage large enough to become resident as it is written
    config = ss.EngineConfig(max_seqs=4, max_context=256, budget_scope="process")
    with ss.Engine(tiny, config) as engine:
        start = engine.pool.resident_bytes
        _fake_readings(monkeypatch, 3 * 2**20, lambda: engine.pool.resident_bytes - start)
        before = engine.ledger.bytes("start")  # the model's ledger: earlier engines' too
        engine.measure_cancel_bound()
        assert engine.pool.resident_bytes > start  # the step wrote pool pages
        assert engine.ledger.bytes("start") - before == 3 * 2**20
