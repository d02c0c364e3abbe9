"""`Admission` under random operation sequences (hypothesis state machine): submit, cancel,
re-admit, finish, expire, pressure and close, with every invariant checked after every step.

It drives the admission object as the engine does (under one lock, on one thread), with a
synthetic clock, so the checks are exact: where each request is, what the pool holds, which
refusals were counted, and that re-admission never leaves a bindable request waiting.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import slotserve as ss
from slotserve.engine.admission import Admission, build_request
from slotserve.engine.events import PRIORITIES, Priority
from slotserve.engine.request import Request
from slotserve.engine.timings import EngineCounters
from slotserve.kv import KVPool
from slotserve.testing import tiny_model

CONFIG = ss.EngineConfig(
    max_seqs=3,
    max_context=64,
    kv_layout="cell",
    block_size=8,
    num_blocks=12,
    queue_depth=3,
    queue_timeout_s=5.0,
)


@functools.cache
def model() -> ss.Model:
    """The tiny model, written to a directory removed once it is loaded (the loaded model
    keeps nothing open there)."""
    with tempfile.TemporaryDirectory(prefix="slotserve-admission-") as directory:
        return tiny_model(Path(directory) / "tiny")


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pressure = False
        self.pool = KVPool(model().info, CONFIG.kv_config())
        self.counters = EngineCounters()
        self.admission = Admission(
            CONFIG, self.pool, self.counters, lambda: self.now, lambda: self.pressure
        )
        self.requests: list[Request] = []
        self.refused: Counter[str] = Counter()

    # -- operations ------------------------------------------------------------------

    @rule(
        priority=st.sampled_from(PRIORITIES),
        prompt_len=st.integers(1, 24),
        max_new=st.integers(0, 40),
        may_queue=st.booleans(),
    )
    def submit(self, priority: Priority, prompt_len: int, max_new: int, may_queue: bool) -> None:
        params = ss.SamplingParams(max_new_tokens=max_new)
        request = build_request(
            len(self.requests),
            model(),
            CONFIG,
            list(range(3, 3 + prompt_len)),
            params,
            priority,
            self.now,
        )
        before = self._where()
        try:
            self.admission.admit(request, may_queue)
        except ss.AdmissionRefused as refusal:
            self.refused[refusal.reason] += 1
            assert self._where() == before, "a refusal changed admission state"
            assert refusal.reason != "closed" or self.admission.closing
            if refusal.reason == "pressure":
                assert priority == "background" and self.pressure
            return
        self.requests.append(request)
        if request.state == "running":
            assert self.pool.length(request.request_id) == 0
        else:
            assert may_queue and request.deadline == self.now + CONFIG.queue_timeout_s

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = [r for r in self.requests if r.state != "done" and not r.cancelled.is_set()]
        if live:
            data.draw(st.sampled_from(live)).cancelled.set()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        running = list(self.admission.running.values())
        if running:
            self._release(data.draw(st.sampled_from(running)))

    @rule(seconds=st.floats(0.0, 4.0))
    def advance_clock(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def toggle_pressure(self) -> None:
        self.pressure = not self.pressure

    @precondition(lambda self: not self.admission.closing)
    @rule()
    def close(self) -> None:
        self.admission.closing = True

    @rule()
    def reap_and_readmit(self) -> None:
        """The engine's batch boundary: end cancelled running requests, let queued ones
        leave, re-admit from the queue."""
        for request in [r for r in self.admission.running.values() if r.cancelled.is_set()]:
            self._release(request)
        for request, outcome in self.admission.take_leaving(self.now):
            if outcome == "cancelled":
                assert request.cancelled.is_set() and not self.admission.closing
            else:
                if outcome in ("queue_timeout", "pressure"):
                    assert request.deadline is not None and self.now >= request.deadline
                    paused = request.priority == "background" and self.pressure
                    assert (outcome == "pressure") == paused
                else:
                    assert outcome == "closed" and self.admission.closing
                assert self.admission.refusal(outcome).reason == outcome  # as the engine does
                self.refused[outcome] += 1
            request.state = "done"
        self.admission.readmit()
        self._check_head_is_blocked()

    # -- checks ----------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.admission.check_integrity()
        self.pool.check_integrity()

    @invariant()
    def every_request_is_in_exactly_one_place(self) -> None:
        running, queued = set(self.admission.running), {r.request_id for r in self.admission.queue}
        for request in self.requests:
            places = [
                request.request_id in running,
                request.request_id in queued,
                request.state == "done",
            ]
            assert sum(places) == 1, (request.request_id, request.state, places)

    @invariant()
    def running_requests_hold_their_worst_case(self) -> None:
        blocks = sum(
            math.ceil(r.reservation / CONFIG.block_size) for r in self.admission.running.values()
        )
        assert self.pool.usage().used == blocks

    @invariant()
    def refusals_are_counted(self) -> None:
        assert +self.counters.refusals == +self.refused

    def _release(self, request: Request) -> None:
        self.admission.release(request)
        request.state = "done"

    def _where(self) -> tuple[frozenset[int], tuple[int, ...], int]:
        return (
            frozenset(self.admission.running),
            tuple(r.request_id for r in self.admission.queue),
            self.pool.usage().free,
        )

    def _check_head_is_blocked(self) -> None:
        """After re-admission, the first queued request in class order that is not paused
        by pressure cannot be bound: no slot, or too few free blocks."""
        order = sorted(self.admission.queue, key=lambda r: PRIORITIES.index(r.priority))
        head = next((r for r in order if not (r.priority == "background" and self.pressure)), None)
        if head is None or self.admission.closing:
            return
        no_slot = len(self.admission.running) >= CONFIG.max_seqs
        needed = math.ceil(head.reservation / CONFIG.block_size)
        assert no_slot or needed > self.pool.usage().free, "a bindable request was left waiting"


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
