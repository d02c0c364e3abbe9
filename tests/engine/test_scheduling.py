"""Priority classes, policies, chunked prefill, queueing and pressure, on real threads."""

from __future__ import annotations

from typing import Any

import pytest

import slotserve as ss
from tests.engine.conftest import RecordingExecutor
from tests.engine.test_release_checklist import LONG, wait_until


def recording_engine(model: ss.Model, **config: Any) -> tuple[ss.Engine, RecordingExecutor]:
    executor = RecordingExecutor(model)
    return ss.Engine(model, ss.EngineConfig(**config), executor=executor), executor


def test_isolate_never_mixes_classes_and_serves_interactive_first(tiny: ss.Model) -> None:
    engine, executor = recording_engine(tiny, max_seqs=4, max_context=256, policy="isolate")
    try:
        background = engine.submit(list(range(3, 40)), LONG, priority="background")
        next(iter(background))
        short = ss.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        chat = engine.submit([5, 6, 7], short, priority="interactive")
        first_chat_step = len(executor.steps)
        chat.result()
        classes = {background.request_id: "background", chat.request_id: "interactive"}
        for step in executor.steps:
            assert len({classes[s] for s, _ in step}) == 1, f"mixed classes in {step}"
        chat_steps = [i for i, step in enumerate(executor.steps) if step[0][0] == chat.request_id]
        # Once admitted, the interactive request ran on consecutive steps (background waited).
        assert chat_steps == list(range(chat_steps[0], chat_steps[0] + 8))  # prefill + 7
        assert chat_steps[0] >= first_chat_step
    finally:
        engine.close()


def test_fifo_co_batches_classes(tiny: ss.Model) -> None:
    engine, executor = recording_engine(tiny, max_seqs=4, max_context=256, policy="fifo")
    try:
        a = engine.submit([5, 6, 7], LONG, priority="background")
        b = engine.submit([8, 9], LONG, priority="interactive")
        wait_until(lambda: any(len(step) == 2 for step in executor.steps))
        a.cancel()
        b.cancel(wait=True)
    finally:
        engine.close()


def test_background_minimum_share(tiny: ss.Model) -> None:
    engine, executor = recording_engine(
        tiny, max_seqs=4, max_context=256, background_min_share=0.25
    )
    try:
        background = engine.submit([5, 6, 7], LONG, priority="background")
        chat = engine.submit([8, 9], LONG, priority="interactive")
        wait_until(lambda: len(executor.steps) > 80)
        recent = executor.steps[-40:]
        share = sum(step[0][0] == background.request_id for step in recent) / len(recent)
        assert 0.2 <= share <= 0.35
        chat.cancel()
        background.cancel(wait=True)
    finally:
        engine.close()


def test_chunked_prefill_does_not_stall_a_running_stream(tiny: ss.Model) -> None:
    engine, executor = recording_engine(
        tiny, max_seqs=2, max_context=256, prefill_chunk=16, max_batch_tokens=17
    )
    try:
        stream = engine.submit([5, 6, 7], ss.SamplingParams(max_new_tokens=100, ignore_eos=True))
        next(iter(stream))
        long_prompt = engine.submit(list(range(3, 203)), ss.SamplingParams(max_new_tokens=2))
        long_prompt.result()
        prefill_steps = [s for s in executor.steps if any(n > 1 for _, n in s)]
        assert len(prefill_steps) >= 200 // 16
        # Every step that prefilled a chunk also advanced the running stream by one token.
        assert all((stream.request_id, 1) in step for step in prefill_steps[1:])
        stream.cancel(wait=True)
    finally:
        engine.close()


def test_queue_waits_then_serves(tiny: ss.Model) -> None:
    engine = ss.Engine(tiny, ss.EngineConfig(max_seqs=1, max_context=256, queue_depth=1))
    try:
        first = engine.submit([5, 6, 7], LONG)
        second = engine.submit([5, 6, 7], ss.SamplingParams(temperature=0, max_new_tokens=5))
        with pytest.raises(ss.AdmissionRefused) as err:
            engine.submit([5], LONG)
        assert err.value.reason == "queue_full"
        assert engine.stats().queue_len == 1
        first.cancel()
        assert second.result().reason in ("stop", "length")
        assert second.finished is not None and second.finished.timings.queue_time > 0
        assert engine.stats().refusals == {"queue_full": 1}
    finally:
        engine.close()


def test_queue_deadline_refuses(tiny: ss.Model) -> None:
    config = ss.EngineConfig(max_seqs=1, max_context=256, queue_depth=1, queue_timeout_s=0.05)
    engine = ss.Engine(tiny, config)
    try:
        blocker = engine.submit([5, 6, 7], ss.SamplingParams(max_new_tokens=250, ignore_eos=True))
        late = engine.submit([5, 6, 7], LONG)
        with pytest.raises(ss.AdmissionRefused) as err:
            late.result()
        assert err.value.reason == "queue_timeout"
        blocker.cancel(wait=True)
        assert engine.stats().refusals == {"queue_timeout": 1}
    finally:
        engine.close()


def test_pressure_pauses_background_and_shrinks_batches(tiny: ss.Model) -> None:
    level = {"value": 0.0}
    engine = ss.Engine(
        tiny,
        ss.EngineConfig(max_seqs=4, max_context=256, policy="fifo"),
        pressure=ss.PressureSource(lambda: level["value"]),
        executor=(executor := RecordingExecutor(tiny)),
    )
    try:
        level["value"] = 2.0
        with pytest.raises(ss.AdmissionRefused) as err:
            engine.submit([5], LONG, priority="background")
        assert err.value.reason == "pressure"
        handles = [engine.submit([5, 6], LONG) for _ in range(3)]
        wait_until(lambda: len(executor.steps) > 10)
        assert max(len(step) for step in executor.steps[-5:]) <= 2
        level["value"] = 0.0
        engine.submit([5], ss.SamplingParams(max_new_tokens=2), priority="background").result()
        for handle in handles:
            handle.cancel()
    finally:
        engine.close()


def test_background_queued_under_pressure_expires_as_pressure(tiny: ss.Model) -> None:
    """A queue lets paused background work wait out a short spell of pressure; if the
    pressure outlasts its deadline, the refusal names the pressure, not the queue."""
    config = ss.EngineConfig(max_seqs=2, max_context=256, queue_depth=2, queue_timeout_s=0.1)
    level = {"value": 2.0}
    engine = ss.Engine(tiny, config, pressure=ss.PressureSource(lambda: level["value"]))
    try:
        paused = engine.submit([5, 6], LONG, priority="background")
        with pytest.raises(ss.AdmissionRefused) as err:
            paused.result()
        assert err.value.reason == "pressure"
        level["value"] = 0.0
        waits = engine.submit([5, 6], ss.SamplingParams(max_new_tokens=2), priority="background")
        assert waits.result().reason in ("stop", "length")
        assert engine.stats().refusals == {"pressure": 1}
    finally:
        engine.close()


def test_stats_report_classes_and_states(tiny: ss.Model) -> None:
    engine = ss.Engine(tiny, ss.EngineConfig(max_seqs=3, max_context=256, kv_layout="cell"))
    try:
        a = engine.submit([5, 6], LONG, priority="interactive")
        b = engine.submit([5, 6], LONG, priority="background")
        next(iter(a))
        wait_until(lambda: engine.stats().steps > 0)
        stats = engine.stats()
        assert stats.slots_in_use == 2 and stats.max_seqs == 3
        assert stats.sessions_by_class == {"interactive": 1, "background": 1}
        assert stats.kv_blocks_used == 2 * 13  # ceil((2 + 200) / 16) blocks each
        assert stats.steps > 0 and stats.admitted == 2
        a.cancel()
        b.cancel(wait=True)
    finally:
        engine.close()
