"""The engine thread's loop: reap, admit, compose a step, run it, release what ended."""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING

from slotserve.engine.events import PRIORITIES
from slotserve.engine.request import Request
from slotserve.engine.stepper import run_step
from slotserve.errors import AdmissionRefused, KVExhausted

if TYPE_CHECKING:
    from slotserve.engine.engine import Engine

IDLE_WAIT_S = 0.05


def engine_loop(engine: Engine) -> None:
    while True:
        with engine._lock:
            _reap(engine)
            _admit_from_queue(engine)
            if engine._closing and not engine._running and not engine._queue:
                return
            pressure = engine._under_pressure()
            max_batch = max(1, engine.config.max_seqs // 2) if pressure else engine.config.max_seqs
            work = engine._scheduler.select(list(engine._running.values()), max_batch)
            if not work:
                engine._lock.wait(IDLE_WAIT_S)
                continue
            starts = [engine.pool.length(r.request_id) for r, _ in work]
        engine._steps_taken += 1
        for request, _ in work:
            request.last_step = engine._steps_taken
        began = engine.clock()
        try:
            finished = run_step(work, starts, engine._executor, engine._kv)
        except Exception:  # a failing step ends its requests, never the engine
            error = traceback.format_exc(limit=3)
            print(f"slotserve: step failed:\n{error}", file=sys.stderr)
            finished = [(request, "error") for request, _ in work]
        seconds = engine.clock() - began
        with engine._lock:
            _count_step(engine, work, seconds)
            for request, reason in finished:
                _end(engine, request, reason)


def _count_step(engine: Engine, work: list[tuple[Request, int]], seconds: float) -> None:
    counters = engine.counters
    counters.steps_by_batch_size[len(work)] += 1
    counters.steps_by_class[work[0][0].priority] += 1
    counters.step_seconds.append(seconds)


def _end(engine: Engine, request: Request, reason: str) -> None:
    """Release the slot and KV first, then send the terminal event."""
    if request.state == "done":
        return
    if request.request_id in engine._running:
        del engine._running[request.request_id]
        engine.pool.release(request.request_id)
    request.timings.released = engine.clock()
    engine.counters.finished[reason] += 1
    if reason == "cancelled":
        engine.counters.cancellations += 1
    request.finish(reason, error="the step failed" if reason == "error" else None)
    request.released.set()
    if engine.on_finished is not None:
        try:
            engine.on_finished(request, reason)
        except Exception:  # an observer's bug must not take the engine down
            traceback.print_exc()


def _reap(engine: Engine) -> None:
    """At the batch boundary: end cancelled requests, refuse expired or closed queue entries."""
    for request in [r for r in engine._running.values() if r.cancelled.is_set()]:
        _end(engine, request, "cancelled")
    now = engine.clock()
    for request in list(engine._queue):
        if request.cancelled.is_set() and not engine._closing:
            engine._queue.remove(request)
            _end(engine, request, "cancelled")
        elif engine._closing or (request.deadline is not None and now >= request.deadline):
            engine._queue.remove(request)
            _refuse_queued(engine, request, "closed" if engine._closing else "queue_timeout")


def fail_all(engine: Engine) -> None:
    """After the loop died: close, end running requests with an error, refuse the queue."""
    with engine._lock:
        engine._closing = True
        for request in list(engine._running.values()):
            if request.state != "done":
                _end(engine, request, "error")
        for request in list(engine._queue):
            engine._queue.remove(request)
            _refuse_queued(engine, request, "closed")


def _refuse_queued(engine: Engine, request: Request, reason: str) -> None:
    engine.counters.refusals[reason] += 1
    request.state = "done"
    request.timings.released = engine.clock()
    request.sink.put(AdmissionRefused(reason, engine.refusal_message(reason)))
    request.released.set()


def _admit_from_queue(engine: Engine) -> None:
    """Bind queued requests in class order, then arrival order; stop at the first that
    cannot be bound so that a large request is not starved by smaller ones behind it."""
    for request in sorted(engine._queue, key=lambda r: PRIORITIES.index(r.priority)):
        if engine._refusal(request) is not None:
            if request.priority == "background":
                continue  # paused by pressure: others may still go
            break
        try:
            engine._bind(request)
        except KVExhausted:
            break
        engine._queue.remove(request)
