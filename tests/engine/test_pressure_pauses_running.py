"""Device pressure pauses background requests already running, not only their admission:
on a real engine over the tiny model, with a fake thermal zone (a file under tmp_path that
the test heats and cools), a running background request takes no step while the zone is
hot (its KV kept, its slot bound), interactive work runs meanwhile, and once the zone
cools the background request goes on to the very tokens of an unpressured run (greedy).
``serve --pressure auto`` (the default) reads such a zone where one can be read."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.cli import build_parser
from slotserve.engine.pressure import PressureSource, pressure_from
from tests.engine.conftest import RecordingExecutor
from tests.engine.test_release_checklist import wait_until

CONFIG = ss.EngineConfig(max_seqs=2, max_context=128)
PROMPT = list(range(3, 20))
BACKGROUND = ss.SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
INTERACTIVE = ss.SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
COOL, HOT = "40000\n", "90000\n"  # millidegrees, as the kernel writes them (85 °C: 1.0)


def thermal_zone(root: Path) -> tuple[Path, str]:
    """A cool fake ``thermal_zone0/temp`` under ``root``, and the glob that reads it."""
    temp = root / "thermal_zone0" / "temp"
    temp.parent.mkdir(parents=True)
    temp.write_text(COOL)
    return temp, str(root / "thermal_zone*" / "temp")


def generated(engine: ss.Engine, request_id: int) -> int:
    """The tokens ``request_id`` has generated so far (from its slot)."""
    (slot,) = [s for s in engine.slots() if s.request_id == request_id]
    return slot.generated_tokens


def holding(engine: ss.Engine, request_id: int) -> object:
    """What ``request_id`` holds in the pool: its slot, rows, blocks and written length."""
    (held,) = [h for h in engine.pool_view().sessions if h.session == request_id]
    return held


def unpressured(model: ss.Model, prompt: list[int], params: ss.SamplingParams) -> ss.Finished:
    with ss.Engine(model, CONFIG) as engine:
        return engine.submit(prompt, params).result()


def test_pressure_pauses_a_running_background_request_and_it_resumes_exactly(
    tiny: ss.Model, tmp_path: Path
) -> None:
    expected = unpressured(tiny, PROMPT, BACKGROUND)
    expected_chat = unpressured(tiny, [5, 6, 7], INTERACTIVE)
    temp, pattern = thermal_zone(tmp_path)
    executor = RecordingExecutor(tiny)
    pressure = PressureSource(thermal_glob=pattern)
    with ss.Engine(tiny, CONFIG, pressure=pressure, executor=executor) as engine:
        background = engine.submit(PROMPT, BACKGROUND, priority="background")
        events = iter(background)
        for _ in range(4):  # running: a few tokens out
            next(events)
        temp.write_text(HOT)
        assert engine.stats().pressure_level == pytest.approx(90 / 85)
        chat = engine.submit([5, 6, 7], INTERACTIVE, priority="interactive")
        chat_events = iter(chat)
        next(chat_events)  # its first step came after the pressure was read
        paused_at = generated(engine, background.request_id)
        kept = holding(engine, background.request_id)
        first_chat_step = len(executor.steps) - 1
        for event in chat_events:  # every interactive step: the background stands still
            engine.check_integrity()
            assert generated(engine, background.request_id) == paused_at, event
        final_chat = chat.result()
        assert (final_chat.reason, final_chat.tokens) == ("length", expected_chat.tokens)
        time.sleep(0.2)  # alone and paused: still no step, still bound, its KV kept
        engine.check_integrity()
        assert generated(engine, background.request_id) == paused_at < 48
        stats = engine.stats()
        assert stats.slots_in_use - stats.slots_parked == 1
        assert holding(engine, background.request_id) == kept
        stepped = {session for step in executor.steps[first_chat_step:] for session, _ in step}
        assert background.request_id not in stepped
        temp.write_text(COOL)
        final = background.result()
        engine.check_integrity()
    assert (final.reason, final.tokens, final.text) == ("length", expected.tokens, expected.text)
    engine.check_integrity()


def test_cancelling_a_paused_background_request_releases_it(tiny: ss.Model, tmp_path: Path) -> None:
    """A paused request is still cancellable: the engine reaps it at its next boundary."""
    temp, pattern = thermal_zone(tmp_path)
    with ss.Engine(tiny, CONFIG, pressure=PressureSource(thermal_glob=pattern)) as engine:
        background = engine.submit(PROMPT, BACKGROUND, priority="background")
        next(iter(background))
        temp.write_text(HOT)
        wait_until(lambda: engine.stats().pressure_level == pytest.approx(90 / 85))
        ack = background.cancel(wait=True)
        assert ack is not None
        assert background.result().reason == "cancelled"
        stats = engine.stats()
        assert stats.slots_in_use - stats.slots_parked == 0
        engine.check_integrity()


def test_serve_defaults_to_thermal_pressure_where_a_zone_is_readable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert build_parser().parse_args(["serve"]).pressure == "auto"
    _, pattern = thermal_zone(tmp_path / "sys")
    (tmp_path / "sys" / "thermal_zone0" / "type").write_text("cpu-thermal\n")
    with caplog.at_level(logging.INFO, logger="slotserve"):
        source = pressure_from("auto", thermal_glob=pattern)
    assert isinstance(source, PressureSource) and source.thermal_glob == pattern
    assert source.level() == pytest.approx(40 / 85)
    assert "thermal_zone0 (cpu-thermal) at 40 °C" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slotserve"):
        assert pressure_from("auto", thermal_glob=str(tmp_path / "none*" / "temp")) is None
    assert "pressure off: no readable thermal zone" in caplog.text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--pressure", "hot"])
