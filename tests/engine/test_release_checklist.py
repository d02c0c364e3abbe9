"""The release checklist of on-device serving: nothing leaks, nothing is half-admitted.

Cancel, drop and admission run on both executors: the eager model and an exported bundle on
the ExecuTorch runtime (`served`)."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import pytest

import slotserve as ss
from slotserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.exports("tiny_bundle")  # `served`, for the executorch cases

LONG = ss.SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)


@pytest.fixture(params=["torch", "executorch"])
def served(request: pytest.FixtureRequest, tiny: ss.Model) -> ss.Model:
    """The tiny model, eager or as its exported fp32 bundle."""
    if request.param == "torch":
        return tiny
    return ss.load(request.getfixturevalue("tiny_bundle"))


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.mark.parametrize("layout", ["flat", "cell", "ring"])
def test_cancel_mid_decode_returns_slot_and_kv(
    make_engine: Any, served: ss.Model, layout: str
) -> None:
    engine = make_engine(served, max_seqs=2, max_context=256, kv_layout=layout, ring_window=64)
    handle = engine.submit([5, 6, 7], LONG)
    events = iter(handle)
    for _ in range(5):
        assert isinstance(next(events), ss.TokenEvent)
    assert engine.stats().slots_in_use == 1 and engine.stats().kv_blocks_used > 0
    ack = handle.cancel(wait=True)
    assert isinstance(ack, ss.CancelAck) and 0 <= ack.latency_s < 5
    stats = engine.stats()
    assert (stats.slots_in_use, stats.kv_blocks_used, stats.cancellations) == (0, 0, 1)
    final = list(events)[-1]
    assert isinstance(final, ss.Finished) and final.reason == "cancelled"
    assert handle.cancel() is None  # idempotent
    engine.check_integrity()


def test_dropped_handle_is_reclaimed(make_engine: Any, served: ss.Model) -> None:
    engine = make_engine(served, max_seqs=2, max_context=256, kv_layout="cell")
    handle = engine.submit([5, 6, 7], LONG)
    next(iter(handle))
    del handle
    gc.collect()
    wait_until(lambda: engine.stats().slots_in_use == 0)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.cancellations == 1
    engine.check_integrity()


def test_admission_at_exactly_max_seqs(make_engine: Any, served: ss.Model) -> None:
    engine = make_engine(served, max_seqs=3, max_context=256, queue_depth=0)
    handles = [engine.submit([5, 6, 7], LONG) for _ in range(3)]
    with pytest.raises(ss.AdmissionRefused) as err:
        engine.submit([5, 6, 7], LONG)
    assert err.value.reason == "slots_full" and "3 slots" in str(err.value)
    handles[0].cancel(wait=True)
    handles.append(engine.submit([5, 6, 7], ss.SamplingParams(temperature=0, max_new_tokens=3)))
    assert handles[-1].result().reason in ("stop", "length")
    assert engine.stats().refusals == {"slots_full": 1}


def test_prompt_over_the_context_is_refused(make_engine: Any) -> None:
    engine = make_engine(max_seqs=2, max_context=64)
    with pytest.raises(ss.AdmissionRefused) as err:
        engine.submit(list(range(3, 60)), ss.SamplingParams(max_new_tokens=10))
    assert err.value.reason == "context_too_long"
    assert "57 tokens + max_new_tokens=10 = 67 exceeds max_context=64" in str(err.value)
    assert engine.stats().slots_in_use == 0


def test_close_mid_prefill_and_mid_decode(make_engine: Any) -> None:
    engine = make_engine(max_seqs=3, max_context=256, prefill_chunk=4, kv_layout="cell")
    decoding = engine.submit([5, 6, 7], LONG)
    next(iter(decoding))
    prefilling = engine.submit(list(range(3, 53)), LONG)
    wait_until(lambda: engine.stats().sessions_by_state.get("prefill", 0) == 1)
    engine.close()
    assert decoding.result().reason == "cancelled"
    assert prefilling.result().reason == "cancelled"
    stats = engine.stats()
    assert (stats.slots_in_use, stats.kv_blocks_used) == (0, 0)
    assert engine.pool.blocks.n_free == engine.pool.blocks.total
    with pytest.raises(ss.AdmissionRefused) as err:
        engine.submit([5], LONG)
    assert err.value.reason == "closed"


def test_engine_refuses_to_start_when_the_plan_does_not_fit(tiny: ss.Model) -> None:
    with pytest.raises(ss.PlanError, match="Largest max_seqs"):
        ss.Engine(tiny, ss.EngineConfig(max_seqs=128, max_context=256, memory_budget="12MiB"))


def test_bundled_cancel_and_drop(bundled: ss.Model, make_engine: Any) -> None:
    engine = make_engine(bundled, max_seqs=2, max_context=512, kv_layout="cell")
    kept = engine.submit("Tell me a story about a robot.", LONG)
    dropped = engine.submit("Tell me a story about a cat.", LONG)
    next(iter(kept))
    next(iter(dropped))
    del dropped
    gc.collect()
    ack = kept.cancel(wait=True)
    assert ack is not None
    wait_until(lambda: engine.stats().slots_in_use == 0)
    assert engine.stats().kv_blocks_used == 0


class BrokenScheduler(Scheduler):
    """A scheduler with a bug: it raises as soon as there is running work to pick from."""

    def select(self, running: list[Any], max_batch: int) -> Any:
        if running:
            raise RuntimeError("scheduler bug")
        return []


def test_a_crashing_engine_loop_fails_requests_instead_of_hanging(tiny: ss.Model) -> None:
    config = ss.EngineConfig(max_seqs=2, max_context=256)
    engine = ss.Engine(tiny, config, scheduler=BrokenScheduler(config))
    handle = engine.submit([5, 6, 7], LONG)
    final = handle.result()
    assert final.reason == "error"
    assert engine.closed and engine.stats().slots_in_use == 0
    with pytest.raises(ss.AdmissionRefused):
        engine.submit([5], LONG)
    engine.close()


def test_kv_exhausted_with_a_small_cell_pool(make_engine: Any) -> None:
    # 8 blocks of 16 positions: one request of 3 + 100 positions takes 7 of them.
    engine = make_engine(max_seqs=3, max_context=256, kv_layout="cell", num_blocks=8)
    params = ss.SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    first = engine.submit([5, 6, 7], params)
    with pytest.raises(ss.AdmissionRefused) as err:
        engine.submit([5, 6, 7], params)
    assert err.value.reason == "kv_exhausted"
    first.cancel(wait=True)
    engine.submit([5, 6, 7], params).cancel(wait=True)
    assert engine.stats().refusals == {"kv_exhausted": 1}


def test_context_too_long_is_counted(make_engine: Any) -> None:
    engine = make_engine(max_seqs=1, max_context=64)
    with pytest.raises(ss.AdmissionRefused):
        engine.submit(list(range(3, 60)), ss.SamplingParams(max_new_tokens=10))
    assert engine.stats().refusals == {"context_too_long": 1}


def test_a_refused_queued_handle_keeps_raising(make_engine: Any) -> None:
    engine = make_engine(max_seqs=1, max_context=256, queue_depth=1, queue_timeout_s=0.05)
    blocker = engine.submit([5, 6, 7], LONG)
    late = engine.submit([5, 6, 7], LONG)
    for _ in range(2):  # a second look must raise again, not hang
        with pytest.raises(ss.AdmissionRefused):
            late.result()
    blocker.cancel(wait=True)


def test_cancelled_async_consumer_does_not_hurt_the_engine(make_engine: Any) -> None:
    import asyncio

    engine = make_engine(max_seqs=2, max_context=256)
    other = engine.submit([8, 9], LONG)
    handle = engine.submit([5, 6, 7], LONG)

    async def give_up() -> None:
        events = handle.__aiter__()
        with contextlib.suppress(TimeoutError):
            while True:
                await asyncio.wait_for(events.__anext__(), 0.0001)

    asyncio.run(give_up())  # its loop is closed now; the engine must not touch it
    handle.cancel(wait=True)
    assert other.result().reason == "length"
    assert not engine.closed


def test_failing_observer_and_pressure_do_not_stop_the_engine(tiny: ss.Model) -> None:
    def broken(*args: Any) -> float:
        raise RuntimeError("observer bug")

    engine = ss.Engine(
        tiny,
        ss.EngineConfig(max_seqs=2, max_context=256),
        pressure=ss.PressureSource(broken),
        on_finished=broken,
    )
    try:
        for _ in range(2):
            final = engine.submit([5, 6], ss.SamplingParams(max_new_tokens=3)).result()
            assert final.reason in ("stop", "length")
        assert not engine.closed
    finally:
        engine.close()
