"""`Engine`: one model, one KV pool, one engine thread that owns the step loop.

`submit` and `cancel` are safe from any thread. Admission happens in `submit` under the
engine lock: a request is bound (slot + its whole worst-case KV reservation) at once, or
waits in the bounded queue, or is refused with a typed reason (`Admission`). The engine
thread, each turn: under the lock, ends what was cancelled or expired, re-admits from the
queue, composes the step (`Scheduler`) and commits it in the pool (`KVPool.begin_step`:
validation, copy-on-write, lengths); then, without the lock, runs it (`Stepper`); then,
under the lock, releases what finished. It alone drives the pool's step bookkeeping.

With ``prefix_cache_bytes`` set, the engine owns a `PrefixCache` over its pool, used only
under the engine lock: admission restores the longest usable prefix into a new request's
session, a request whose opening prefill completed publishes its prompt's snapshot right
after that step, and one submitted with ``publish_completion`` hands its prompt and
completion to the cache when it ends (a conversation's next turn restores them); in the
flat layout every generation does, its slot parked (`KVPool.parks_slots`). Closing
empties the cache, so the pool is back at its baseline. With ``prefix_store`` the cache has
a disk tier (`slotserve.prefix.store`), opened and indexed here: snapshots are written by
its own thread and a restart restores them; closing waits for its queued writes. A request
bound to be restored from the store is read by the restore thread (`Restorer`), never under
the engine lock: the others' steps go on meanwhile, and a cancel releases it at the step
boundary after the read's next part.

Locks: the engine lock ranks first (`slotserve.locks`): under it the engine may take the
store's lock (inside the cache) and a write ticket's, never the other way round. A handle
dropped without cancel (a weakref finalizer, run by whatever thread a garbage-collection
pass lands on) takes no lock: it records its id (`_drop`) and the engine thread cancels it
at its next batch boundary.

An engine still open when the interpreter exits is closed first (its thread stopped
between steps), so a script may end while requests run.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from slotserve.engine.admission import Admission, build_request, check_embedding
from slotserve.engine.cancel_bound import CancelBound, declare_cancel_bound, largest_step_tokens
from slotserve.engine.config import EngineConfig
from slotserve.engine.device import DeviceSeat
from slotserve.engine.draft import ModelDrafter, open_draft_model
from slotserve.engine.events import (
    CancelAck,
    Finished,
    FinishReason,
    Pooling,
    check_priority,
)
from slotserve.engine.handle import RequestHandle
from slotserve.engine.prefix_share import open_prefix_cache
from slotserve.engine.pressure import PressureSource
from slotserve.engine.probe import ledger_for, time_largest_step
from slotserve.engine.request import Request
from slotserve.engine.restore import Restorer
from slotserve.engine.scheduler import Scheduler
from slotserve.engine.speculate import refusal, speculator_for
from slotserve.engine.stepper import Stepper, Work
from slotserve.engine.timings import EngineCounters
from slotserve.engine.views import (
    EngineStats,
    PoolView,
    SlotView,
    engine_stats,
    pool_view,
    prefix_stats,
    slot_views,
)
from slotserve.errors import AdmissionRefused
from slotserve.executor import Executor, HiddenStates, executor_for
from slotserve.kv.batch import StepBatch
from slotserve.kv.pool import KVPool
from slotserve.locks import ENGINE, OrderedLock
from slotserve.memory import IdleTrim, MemoryLedger, trim_heap
from slotserve.model import Model
from slotserve.plan import CapacityPlan
from slotserve.prefix import PendingRestore
from slotserve.sampling import SamplingParams

log = logging.getLogger("slotserve")
IDLE_WAIT_S = 0.05
# A pause this long with nothing to step gives the C heap's free pages back (`IdleTrim`).
IDLE_TRIM_S = 1.0
EXIT_CLOSE_TIMEOUT_S = 5.0


class Engine:
    """Serves many requests on one model; see the module docstring for the contract.

    ``on_finished`` observes every request that ran, with its public `Finished` event, on
    the engine thread after its release. ``scheduler`` replaces the step policy (default
    `Scheduler`); ``clock`` stamps every timestamp of every request. ``ledger`` is the
    process's memory ledger (default: the one `slotserve.load` filled); the engine plans
    against it and adds its own start state (`plan`). ``device``: its seat at a served
    set's `DeviceScheduler`, whose turn each step takes (docs/MODELS.md). ``draft``: the
    draft model of ``speculate="draft"`` (default: `slotserve.load` of the config's
    ``draft_model``), whose weights, KV and activations join the ledger before the plan is
    checked (`slotserve.engine.draft`).
    """

    def __init__(
        self,
        model: Model,
        config: EngineConfig | None = None,
        *,
        pressure: PressureSource | None = None,
        executor: Executor | None = None,
        scheduler: Scheduler | None = None,
        on_finished: Callable[[Finished], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        ledger: MemoryLedger | None = None,
        device: DeviceSeat | None = None,
        draft: Model | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        if self.config.max_context > model.info.max_context:
            raise ValueError(
                f"max_context={self.config.max_context} exceeds the model's context "
                f"{model.info.max_context}; use at most {model.info.max_context}"
            )
        executor = executor or executor_for(model)
        self.config = self.config.within_step_limit(executor.max_step_tokens)
        # The memory ledger this engine plans with: passed in, or the load's (with
        # budget_scope="process"), its start state measured by the probes (`ledger_for`),
        # whose steps take a background turn on a served set's device like any other.
        with nullcontext() if device is None else device.turn("background"):
            self.ledger = ledger_for(model, self.config, executor, ledger)
        attention = model.kernels.attention if self.config.kernels == "auto" else None
        self._attention_kernel = attention is not None
        drafting = None  # the draft model, where the engine drafts with one
        if refusal(self.config, executor) is None:
            drafting = open_draft_model(self.config, model, self.ledger, draft)
        self.plan.check()  # PlanError: refuse to start (a draft model's arenas counted)
        self.pool = KVPool(model.info, self.config.kv_config(), attention)
        self.prefix = open_prefix_cache(
            self.config, model, self.pool, attention_kernel=attention is not None
        )
        self.pressure = pressure
        self.on_finished = on_finished
        self.clock = clock
        self.device = device  # a served set's: each step takes its turn on the device
        self.counters = EngineCounters()
        # (A Condition takes any lock with the RLock's methods; typeshed names only its own.)
        lock: Any = OrderedLock("engine", ENGINE, reentrant=True)
        self._lock = threading.Condition(lock)
        self._admission = Admission(
            self.config, self.pool, self.counters, clock, self._under_pressure, self.prefix
        )
        self._scheduler = scheduler or Scheduler(self.config, self._under_pressure)
        drafter = None
        if drafting is not None:
            drafter = ModelDrafter(drafting, self.config, executor.weight_bytes)
        speculator = speculator_for(self.config, executor, drafter)
        self._stepper = Stepper(executor, self.pool, clock, speculator)
        self._known: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        # (An empty store is falsy: its length is its files.)
        self._restorer = (
            Restorer(self.prefix, self._lock, self._admission, self._end)
            if self.prefix is not None and self.prefix.store is not None
            else None
        )
        # Bound, their stored prefix being read: neither stepped nor reaped meanwhile.
        self._restoring: set[int] = set() if self._restorer is None else self._restorer.restoring
        self._dropped: deque[int] = deque()  # handles collected without cancel (`_drop`)
        self._ids = itertools.count()
        self._steps_taken = 0
        self._idle_trim = IdleTrim(IDLE_TRIM_S, trim_heap)  # engine thread only
        self._thread = threading.Thread(target=self._loop, name="slotserve-engine", daemon=True)
        self._close_at_exit = _exit_closer(weakref.ref(self))
        atexit.register(self._close_at_exit)
        self._thread.start()

    # -- caller API (any thread) -----------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: str = "normal",
        *,
        queue: bool = True,
        publish_completion: bool = False,
        pooling: Pooling | None = None,
    ) -> RequestHandle:
        """Admit a request, queue it (``queue`` and room in the queue), or raise
        `AdmissionRefused`. ``prompt`` is text (tokenised here) or token ids. Returns the
        handle to iterate for its events. With ``publish_completion`` and the prefix cache
        on, the request's prompt and completion stay cached when it ends (unless it fails),
        so a next turn that continues the conversation restores them instead of computing
        them again. With ``pooling`` it is an embedding request: prefill only
        (``max_new_tokens=0``), admitted and scheduled as any other, its final hidden states
        pooled into ``Finished.embedding``."""
        params = params or SamplingParams()
        if pooling is not None:
            check_embedding(params, self.embeds)
        try:
            request = build_request(
                next(self._ids),
                self.model,
                self.config,
                prompt,
                params,
                check_priority(priority),
                self.clock(),
            )
        except AdmissionRefused as refusal:
            with self._lock:
                self.counters.refusals[refusal.reason] += 1
            raise
        request.publish_completion = publish_completion
        request.pooling = pooling
        with self._lock:
            pending = self._admission.admit(request, queue, defer_store=True)
            self._known[request.request_id] = request
            if pending is not None:
                self._start_restore(request, pending)
            self._lock.notify_all()
        return RequestHandle(
            request.request_id, request.sink, self._cancel, self._drop, request.timings
        )

    def _start_restore(self, request: Request, pending: PendingRestore) -> None:
        """Under the lock: hand ``request``'s stored prefix to the restore thread."""
        assert self._restorer is not None  # a pending restore comes only from the store
        self._restorer.start(request, pending)

    @property
    def embeds(self) -> bool:
        """Whether this engine's executor gives final hidden states (embedding requests)."""
        executor = self._stepper.executor
        return isinstance(executor, HiddenStates) and executor.embeds

    def _drop(self, request_id: int) -> None:
        """A handle collected without cancel: note its id for the engine thread, which
        cancels it at its next batch boundary (`_reap`). Takes no lock and touches nothing
        else: a finalizer may run it on any thread, in the middle of anything."""
        self._dropped.append(request_id)

    def _cancel(self, request_id: int, wait: bool, timeout: float | None) -> CancelAck | None:
        with self._lock:
            request = self._known.get(request_id)
            if request is None or request.state == "done":
                return CancelAck(0.0) if wait else None
            request.cancel(self.clock())
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
        atexit.unregister(self._close_at_exit)
        with self._lock:
            self._admission.closing = True
            running = [] if drain else list(self._admission.running.values())
            for request in [*self._admission.queue, *running]:
                request.cancel(self.clock())
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine did not stop within %ss", timeout)
            return
        if self._restorer is not None:
            self._restorer.shutdown()
        if self.prefix is not None and self.prefix.store is not None:
            self.prefix.store.close()  # its queue was flushed when the cache was cleared

    @property
    def closed(self) -> bool:
        """True once `close` was called: nothing more is admitted."""
        return self._admission.closing

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and gauges (`EngineStats`)."""
        # Outside the lock: the pool's storage never moves, and reading the page map of a
        # large pool takes a few milliseconds that no step should wait for.
        resident = self.pool.resident_bytes
        with self._lock:
            return engine_stats(
                self.pool,
                self.config.max_seqs,
                list(self._admission.running.values()),
                len(self._admission.queue),
                self.counters,
                pressure_level=None if self.pressure is None else self.pressure.reading(),
                prefix=prefix_stats(self.prefix),
                cancel_bound=self.cancel_bound(),
                kv_resident_bytes=resident,
                speculation=self._stepper.speculation(),
            )

    def cancel_bound(self) -> CancelBound:
        """The declared worst-case cancel→release time: the largest step this config allows
        (`largest_step_tokens`), timed from the steps measured so far, beside the measured
        cancel→release p99 (`slotserve.engine.cancel_bound`)."""
        with self._lock:
            counters = self.counters
            return declare_cancel_bound(
                largest_step_tokens(self.config),
                counters.step_seconds_by_tokens,
                counters.cancel_seconds,
            )

    @property
    def plan(self) -> CapacityPlan:
        """The memory plan: the ledger's arenas as they stand now, and this config's KV pool
        and activations. A part that adds an arena to ``ledger`` checks it again
        (``engine.plan.check()``)."""
        return self.config.plan(
            self.model.info, self.ledger, attention_kernel=self._attention_kernel
        )

    def measure_cancel_bound(self) -> CancelBound:
        """Time the largest step this config allows on the engine's own pool before it
        serves (`slotserve.engine.probe.time_largest_step`) and count it as a measured step
        of that size, so the declared bound (`cancel_bound`: ``/slots``, ``/metrics``, the
        dashboard) has seconds from the start (`slotserve serve` calls it). Only while no
        session is bound, under the engine lock; the bound unchanged when sessions are bound
        or the pool cannot hold that step's sessions. What the step leaves is one-time state
        in the ledger's runtime arena (process scope: `PlanError` if the budget then does
        not hold the plan)."""
        with self._lock:
            if self.pool.sessions:
                return self.cancel_bound()
            executor = self._stepper.executor
            timed = time_largest_step(self.model, self.config, executor, self.pool, self.ledger)
            if timed is not None:
                self.plan.check()
                self.counters.count_step_time(*timed)
            return self.cancel_bound()

    def slots(self) -> list[SlotView]:
        """Each slot of the pool: idle, or the request it serves (state, class, tokens, age)."""
        now = self.clock()
        with self._lock:
            running = self._admission.running.values()
            return slot_views(self.pool, self.config.max_seqs, running, now)

    def pool_view(self) -> PoolView:
        """The KV pool's occupancy and exactly which blocks and rows each running request
        (by request id) and each prefix-cache snapshot holds, read from the pool's own
        tables in one go under the engine lock."""
        with self._lock:
            return pool_view(self.pool, self.config.kv_layout)

    def check_integrity(self) -> None:
        """Pool and admission invariants (every running request bound in the pool)."""
        with self._lock:
            self.pool.check_integrity()
            self._admission.check_integrity()
            self._stepper.check_integrity()
            if self.prefix is not None:
                self.prefix.check_integrity()

    # -- engine thread ---------------------------------------------------------------

    def _under_pressure(self) -> bool:
        if self.pressure is None:
            return False
        try:
            return self.pressure.under_pressure()
        except Exception:  # an unreadable signal counts as no pressure
            log.exception("pressure signal unreadable; taken as no pressure")
            return False

    def _loop(self) -> None:
        try:
            while (step := self._next_step()) is not None:
                self._run(*step)
        except BaseException:
            # A bug in the loop must not leave callers waiting forever: end every request
            # with an error, refuse new ones, and say what happened.
            log.exception("engine loop failed; ending every request")
            self._fail_all()

    def _next_step(self) -> tuple[Work, StepBatch] | None:
        """Under the lock: reap, re-admit, compose the next step and commit it in the pool
        (None once closed and idle). Waits while there is nothing to do."""
        with self._lock:
            while True:
                self._reap()
                for request, pending in self._admission.readmit():
                    self._start_restore(request, pending)
                if self._admission.closing and self._admission.idle:
                    self._clear_prefix()
                    return None
                ready = [
                    r for r in self._admission.running.values()
                    if r.request_id not in self._restoring
                ]  # fmt: skip
                work = self._scheduler.select(ready, self.config.max_seqs)
                work = self._stepper.draft(work, self.pool)
                if not work:
                    self._idle_trim.idle()  # under the lock: a submit waits the trim
                    self._lock.wait(IDLE_WAIT_S)
                    continue
                self._idle_trim.busy()
                try:
                    return work, self._commit(work)
                except Exception:  # a step the pool refuses ends its requests, not the engine
                    log.exception("step refused by the KV pool; ending its requests")
                    for request, _ in work:
                        self._end(request, "error")

    def _commit(self, work: Work) -> StepBatch:
        """The step's batch, validated and committed in the pool (copy-on-write, lengths)."""
        batch = StepBatch(
            [r.request_id for r, _ in work],
            [self.pool.length(r.request_id) for r, _ in work],
            [n for _, n in work],
        )
        self.pool.begin_step(batch)
        self._steps_taken += 1
        for request, _ in work:
            request.last_step = self._steps_taken
        return batch

    def _run(self, work: Work, batch: StepBatch) -> None:
        began = self.clock()
        try:
            turn = nullcontext() if self.device is None else self.device.turn(work[0][0].priority)
            with turn:
                finished = self._stepper.run(work, batch)
        except Exception:  # a failing step ends its requests, never the engine
            log.exception("step failed; ending its %d requests", len(work))
            finished = [(request, "error") for request, _ in work]
        seconds = self.clock() - began
        with self._lock:
            tokens = sum(n for _, n in work)
            self.counters.count_step(len(work), work[0][0].priority, seconds, tokens)
            failed = {id(r) for r, reason in finished if reason == "error"}
            self._stepper.settle(self.pool)  # rejected draft rows, before any release
            self._admission.publish_prompts([r for r, _ in work if id(r) not in failed])
            for request, reason in finished:
                self._end(request, reason)

    def _clear_prefix(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    def _end(self, request: Request, reason: FinishReason) -> None:
        """Release the slot and KV first, then send the terminal event (`Admission.end`)."""
        finished = self._admission.end(request, reason)
        if finished is not None and self.on_finished is not None:
            try:
                self.on_finished(finished)
            except Exception:  # an observer's bug must not take the engine down
                log.exception("on_finished observer failed")

    def _reap(self) -> None:
        """At the batch boundary: cancel the requests whose handles were dropped; end
        cancelled requests; queued ones that leave (cancelled, expired, closed out) end or
        are refused."""
        while self._dropped:
            request = self._known.get(self._dropped.popleft())
            if request is not None and request.state != "done":
                request.cancel(self.clock())
        for request in list(self._admission.running.values()):
            if request.cancelled.is_set() and request.request_id not in self._restoring:
                self._end(request, "cancelled")  # (one being restored: once it is)
        for request, outcome in self._admission.take_leaving(self.clock()):
            if outcome == "cancelled":
                self._end(request, "cancelled")
            else:
                self._admission.refuse_queued(request, outcome)

    def _fail_all(self) -> None:
        """After the loop died: close, end running requests with an error, refuse the queue."""
        with self._lock:
            self._admission.closing = True
            for request in list(self._admission.running.values()):
                self._end(request, "error")
            for request, _ in self._admission.take_leaving(self.clock()):
                self._admission.refuse_queued(request, "closed")
            self._clear_prefix()


def _exit_closer(engine_ref: weakref.ref[Engine]) -> Callable[[], None]:
    """An atexit hook that closes the engine if it still lives (holding no reference)."""

    def close_at_exit() -> None:
        engine = engine_ref()
        if engine is not None:
            engine.close(timeout=EXIT_CLOSE_TIMEOUT_S)

    return close_at_exit
