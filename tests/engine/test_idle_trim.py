"""The engine gives the C heap's free pages back once traffic pauses (issue 27): a step's
activations are freed when it ends, but malloc keeps their pages until a trim."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import slotserve as ss
from slotserve.engine import engine as engine_module

PARAMS = ss.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
PAUSE_S = 0.5


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the engine did not trim within 10 s"
        time.sleep(0.01)


def test_the_engine_trims_once_a_pause_after_it_stepped(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    trims: list[float] = []
    monkeypatch.setattr(engine_module, "IDLE_TRIM_S", PAUSE_S)
    monkeypatch.setattr(engine_module, "trim_heap", lambda: trims.append(time.monotonic()))
    with ss.Engine(tiny, ss.EngineConfig(max_seqs=2, max_context=64)) as engine:
        time.sleep(2 * PAUSE_S)
        assert trims == []  # nothing stepped yet: nothing to give back
        for round_ in (1, 2):
            engine.submit("Hello", PARAMS).result()
            done = time.monotonic()
            _wait_for(lambda: len(trims) == round_)  # noqa: B023 (waited for here)
            # Not before the pause (its start is the engine's, a little before ``done``).
            assert trims[-1] - done >= PAUSE_S / 2
            time.sleep(2 * PAUSE_S)
            assert len(trims) == round_  # once a pause
