"""`Engine`: one model, one KV pool, one engine thread that owns the step loop.

`submit` and `cancel` are safe from any thread. Admission happens in `submit` under the
engine lock: a request is bound (slot + its whole worst-case KV reservation) at once, or
waits in the bounded queue, or is refused with a typed reason. The engine thread composes
each step (`Scheduler`), runs it (`run_step`), and releases what finished or was cancelled
at the next batch boundary.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from slotserve.engine.admission import build_request
from slotserve.engine.config import EngineConfig
from slotserve.engine.events import PRIORITIES, CancelAck
from slotserve.engine.handle import RequestHandle
from slotserve.engine.locked_kv import LockedKV
from slotserve.engine.pressure import PressureSource
from slotserve.engine.request import Request
from slotserve.engine.scheduler import Scheduler
from slotserve.errors import AdmissionRefused, KVExhausted
from slotserve.executor import Executor, TorchExecutor
from slotserve.kv.pool import KVPool
from slotserve.metrics import EngineCounters
from slotserve.model import Model
from slotserve.sampling import SamplingParams


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. KV blocks are cell blocks (cell layout) or slot rows."""

    slots_in_use: int
    max_seqs: int
    sessions_by_class: dict[str, int]
    sessions_by_state: dict[str, int]
    kv_blocks_free: int
    kv_blocks_used: int
    kv_pool_bytes: int
    queue_len: int
    admitted: int
    finished: dict[str, int]
    refusals: dict[str, int]
    cancellations: int
    steps: int
    steps_by_batch_size: dict[int, int] = field(default_factory=dict)
    steps_by_class: dict[str, int] = field(default_factory=dict)


class Engine:
    """Serves many requests on one model; see the module docstring for the contract."""

    def __init__(
        self,
        model: Model,
        config: EngineConfig | None = None,
        *,
        pressure: PressureSource | None = None,
        executor: Executor | None = None,
        on_finished: Callable[[Request, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        if self.config.max_context > model.info.max_context:
            raise ValueError(
                f"max_context={self.config.max_context} exceeds the model's context "
                f"{model.info.max_context}; use at most {model.info.max_context}"
            )
        self.plan = self.config.plan(model.info, model.weight_bytes)
        self.plan.check()  # PlanError: refuse to start
        self.pool = KVPool(model.info, self.config.kv_config())
        self.pressure = pressure
        self.on_finished = on_finished  # called on the engine thread after each release
        self.clock = clock  # every timestamp of every request comes from here
        self.counters = EngineCounters()
        self._executor = executor or TorchExecutor(model)
        self._lock = threading.Condition(threading.RLock())
        self._kv = LockedKV(self.pool, self._lock)
        self._scheduler = Scheduler(self.config)
        self._running: dict[int, Request] = {}
        self._queue: list[Request] = []
        self._known: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self._ids = itertools.count()
        self._closing = False
        self._steps_taken = 0
        self._thread = threading.Thread(target=self._loop, name="slotserve-engine", daemon=True)
        self._thread.start()

    # -- caller API (any thread) -----------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: str = "normal",
        *,
        queue: bool = True,
    ) -> RequestHandle:
        """Admit a request, queue it (``queue`` and room in the queue), or raise
        `AdmissionRefused`. Returns the handle to iterate for its events."""
        params = params or SamplingParams()
        try:
            request = build_request(
                next(self._ids), self.model, self.config, prompt, params, priority, self.clock
            )
        except AdmissionRefused as refusal:
            with self._lock:
                self.counters.refusals[refusal.reason] += 1
            raise
        with self._lock:
            self._admit_or_queue(request, queue)
            self._known[request.request_id] = request
            self._lock.notify_all()
        return RequestHandle(request.request_id, request.sink, self._cancel)

    def _admit_or_queue(self, request: Request, may_queue: bool) -> None:
        reason = self._refusal(request)
        if reason == "closed":
            self._refuse(reason)
        if reason is None and not self._queue_ahead_of(request):
            try:
                self._bind(request)
                return
            except KVExhausted:
                reason = "kv_exhausted"
        if not may_queue or self.config.queue_depth == 0:
            self._refuse(reason or "slots_full")
        if len(self._queue) >= self.config.queue_depth:
            self._refuse("queue_full")
        request.deadline = self.clock() + self.config.queue_timeout_s
        self._queue.append(request)

    def _queue_ahead_of(self, request: Request) -> bool:
        """Whether a queued request of the same or a higher class waits already."""
        rank = PRIORITIES.index(request.priority)
        return any(PRIORITIES.index(r.priority) <= rank for r in self._queue)

    def _refusal(self, request: Request) -> str | None:
        """Why ``request`` cannot be bound now, KV aside (None: it can try)."""
        if self._closing:
            return "closed"
        if request.priority == "background" and self._under_pressure():
            return "pressure"
        if len(self._running) >= self.config.max_seqs:
            return "slots_full"
        return None

    def _refuse(self, reason: str) -> NoReturn:
        self.counters.refusals[reason] += 1
        raise AdmissionRefused(reason, self.refusal_message(reason))

    def refusal_message(self, reason: str) -> str:
        config = self.config
        return {
            "closed": "the engine is closed",
            "pressure": "the device is under pressure; background work is paused",
            "slots_full": f"all {config.max_seqs} slots (max_seqs) are in use",
            "kv_exhausted": "the KV pool cannot hold this request's worst case now",
            "queue_full": f"the admission queue is full ({config.queue_depth} waiting)",
            "queue_timeout": f"no slot freed within queue_timeout_s={config.queue_timeout_s}",
        }[reason]

    def _bind(self, request: Request) -> None:
        """Reserve the slot and the whole worst-case KV (raises KVExhausted, unchanged)."""
        self.pool.reserve(request.request_id, request.reservation)
        request.state = "running"
        request.timings.admitted = self.clock()
        self._running[request.request_id] = request
        self.counters.admitted += 1

    def _cancel(self, request_id: int, wait: bool, timeout: float | None) -> CancelAck | None:
        with self._lock:
            request = self._known.get(request_id)
            if request is None or request.state == "done":
                return CancelAck(0.0) if wait else None
            if request.timings.cancel_requested is None:
                request.timings.cancel_requested = self.clock()
            request.cancelled.set()
            self._lock.notify_all()
        if not wait:
            return None
        if not request.released.wait(timeout):
            raise TimeoutError(f"request {request_id} was not released within {timeout}s")
        return CancelAck(request.timings.cancel_to_release or 0.0)

    def close(self, drain: bool = False, timeout: float = 60.0) -> None:
        """Stop admitting; refuse queued requests (``closed``); cancel running ones (or, with
        ``drain``, let them finish); wait for the engine thread. The pool is back at its
        baseline afterwards (a warning says so if the thread did not stop in time)."""
        with self._lock:
            self._closing = True
            for request in [*self._queue, *([] if drain else self._running.values())]:
                if request.timings.cancel_requested is None:
                    request.timings.cancel_requested = self.clock()
                request.cancelled.set()
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            print(f"slotserve: engine did not stop within {timeout}s", file=sys.stderr)

    @property
    def closed(self) -> bool:
        """True once `close` was called: nothing more is admitted."""
        return self._closing

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> EngineStats:
        with self._lock:
            running = list(self._running.values())
            cell = bool(self.pool.blocks.total)
            return EngineStats(
                slots_in_use=len(running),
                max_seqs=self.config.max_seqs,
                sessions_by_class=dict(Counter(r.priority for r in running)),
                sessions_by_state=dict(
                    Counter("prefill" if r.in_prefill else "decode" for r in running)
                    + Counter(queued=len(self._queue))
                ),
                kv_blocks_free=self.pool.blocks.n_free if cell else self.pool.free_slots,
                kv_blocks_used=self.pool.blocks.n_used if cell else len(running),
                kv_pool_bytes=self.pool.nbytes,
                queue_len=len(self._queue),
                admitted=self.counters.admitted,
                finished=dict(self.counters.finished),
                refusals=dict(self.counters.refusals),
                cancellations=self.counters.cancellations,
                steps=sum(self.counters.steps_by_batch_size.values()),
                steps_by_batch_size=dict(self.counters.steps_by_batch_size),
                steps_by_class=dict(self.counters.steps_by_class),
            )

    def slots(self) -> list[dict[str, object]]:
        """Each slot of the pool: idle, or the request it serves (state, class, tokens, age)."""
        now = self.clock()
        with self._lock:
            by_slot = {
                self.pool.sessions[r.request_id].slot: r
                for r in self._running.values()
                if r.request_id in self.pool.sessions
            }
            return [_slot_view(i, by_slot.get(i), now) for i in range(self.config.max_seqs)]

    def check_integrity(self) -> None:
        """Pool invariants, and every running request bound in the pool."""
        with self._lock:
            self.pool.check_integrity()
            assert set(self._running) == set(self.pool.sessions), "running ≠ pool sessions"

    # -- engine thread ---------------------------------------------------------------

    def _under_pressure(self) -> bool:
        if self.pressure is None:
            return False
        try:
            return self.pressure.under_pressure()
        except Exception:  # an unreadable signal counts as no pressure
            traceback.print_exc()
            return False

    def _loop(self) -> None:
        from slotserve.engine.loop import engine_loop, fail_all

        try:
            engine_loop(self)
        except BaseException:
            # A bug in the loop must not leave callers waiting forever: end every request
            # with an error, refuse new ones, and say what happened.
            traceback.print_exc()
            fail_all(self)


def _slot_view(slot: int, request: Request | None, now: float) -> dict[str, object]:
    if request is None:
        return {"slot": slot, "state": "idle"}
    return {
        "slot": slot,
        "state": "prefill" if request.in_prefill else "decode",
        "request_id": request.request_id,
        "class": request.priority,
        "prompt_tokens": len(request.prompt),
        "generated_tokens": len(request.generated),
        "age_s": round(now - request.timings.submitted, 3),
    }
