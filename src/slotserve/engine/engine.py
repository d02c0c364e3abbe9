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
its own thread and a restart restores them; closing waits for its queued writes. A
request bound to be restored from the store (by `submit`, or re-admitted from the queue) is
read into its own fresh reservation by the engine's restore thread, never under the engine
lock (`PrefixCache.read`): `submit` returns at once and the steps of the others go on
meanwhile; the request is neither stepped nor reaped until the read is committed
(`_restore`), and a cancel stops the read at its next part, so it is released at the step
boundary after that.

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
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slotserve.engine.admission import Admission, build_request
from slotserve.engine.cancel_bound import CancelBound, declare_cancel_bound, largest_step_tokens
from slotserve.engine.config import EngineConfig
from slotserve.engine.events import (
    CancelAck,
    Finished,
    FinishReason,
    Pooling,
    check_priority,
)
from slotserve.engine.handle import RequestHandle
from slotserve.engine.pressure import PressureSource
from slotserve.engine.probe import largest_step, ledger_for
from slotserve.engine.request import Request
from slotserve.engine.scheduler import Scheduler
from slotserve.engine.stepper import Stepper, Work
from slotserve.engine.timings import EngineCounters
from slotserve.engine.views import EngineStats, PoolView, PrefixStats, SlotView, store_stats
from slotserve.errors import AdmissionRefused, KVExhausted
from slotserve.executor import Executor, HiddenStates, executor_for
from slotserve.kv.batch import StepBatch
from slotserve.kv.pool import KVPool
from slotserve.locks import ENGINE, OrderedLock
from slotserve.memory import MemoryLedger, parse_bytes, trim_heap
from slotserve.model import Model
from slotserve.native.threads import on_own_thread
from slotserve.plan import CapacityPlan
from slotserve.prefix import PendingRestore, PrefixCache, PrefixStore, open_store
from slotserve.sampling import SamplingParams

log = logging.getLogger("slotserve")
IDLE_WAIT_S = 0.05
# After this long with nothing to step, the engine gives the C heap's free pages back
# (`trim_heap`): a step's activations are freed when it ends, but malloc keeps their pages,
# 16-31 MiB after four 1,500-token prompts on the bundled model. The trim takes 2-3 ms,
# and the next step faults the pages it uses back in, so it waits for a pause in traffic.
IDLE_TRIM_S = 1.0
EXIT_CLOSE_TIMEOUT_S = 5.0


class Engine:
    """Serves many requests on one model; see the module docstring for the contract.

    ``on_finished`` observes every request that ran, with its public `Finished` event, on
    the engine thread after its release. ``scheduler`` replaces the step policy (default
    `Scheduler`); ``clock`` stamps every timestamp of every request. ``ledger`` is the
    process's memory ledger (default: the one `slotserve.load` filled); the engine plans
    against it and adds its own start state (`plan`).
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
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        if self.config.max_context > model.info.max_context:
            raise ValueError(
                f"max_context={self.config.max_context} exceeds the model's context "
                f"{model.info.max_context}; use at most {model.info.max_context}"
            )
        executor = executor or executor_for(model)
        self.config = _within_step_limit(self.config, executor.max_step_tokens)
        # The memory ledger this engine plans with: passed in, or the load's (with
        # budget_scope="process"), its start state measured by the probes (`ledger_for`).
        self.ledger = ledger_for(model, self.config, executor, ledger)
        attention = model.kernels.attention if self.config.kernels == "auto" else None
        self._attention_kernel = attention is not None
        self.plan.check()  # PlanError: refuse to start
        self.pool = KVPool(model.info, self.config.kv_config(), attention)
        # One cache per engine, over this engine's pool: every snapshot was computed with
        # this model's weights, weight format, rope settings and KV dtype, so no key needs
        # to name them and a change of any of them cannot produce a stale hit.
        budget = self.config.prefix_cache_budget
        store = self._open_store(attention is not None) if budget else None
        write_prompts = self.config.prefix_store_writes == "all"
        self.prefix = (
            PrefixCache(self.pool, budget, store, write_prompts=write_prompts) if budget else None
        )
        self.pressure = pressure
        self.on_finished = on_finished
        self.clock = clock
        self.counters = EngineCounters()
        # (A Condition takes any lock with the RLock's methods; typeshed names only its own.)
        lock: Any = OrderedLock("engine", ENGINE, reentrant=True)
        self._lock = threading.Condition(lock)
        self._admission = Admission(
            self.config, self.pool, self.counters, clock, self._under_pressure, self.prefix
        )
        self._scheduler = scheduler or Scheduler(self.config)
        self._stepper = Stepper(executor, self.pool, clock)
        self._known: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self._restoring: set[int] = set()  # bound, their stored prefix being read (_restore)
        # (An empty store is falsy: its length is its files.)
        self._restorer = (
            ThreadPoolExecutor(1, thread_name_prefix="slotserve-restore")
            if store is not None
            else None
        )
        self._dropped: deque[int] = deque()  # handles collected without cancel (`_drop`)
        self._ids = itertools.count()
        self._steps_taken = 0
        self._idle_since: float | None = None  # engine thread only: `_trim_when_idle`
        self._trimmed = True
        self._thread = threading.Thread(target=self._loop, name="slotserve-engine", daemon=True)
        self._close_at_exit = _exit_closer(weakref.ref(self))
        atexit.register(self._close_at_exit)
        self._thread.start()

    def _open_store(self, attention_kernel: bool) -> PrefixStore | None:
        """The prefix cache's disk tier (``prefix_store``), indexed now, so the first
        request can hit; `PrefixStoreError` if its directory cannot be written."""
        config = self.config
        if config.prefix_store is None:
            return None
        return open_store(
            config.prefix_store, config.prefix_store_budget, self.model, self.pool,
            attention_kernel=attention_kernel,
            write_rate=parse_bytes(config.prefix_store_write_rate),
            min_tokens=config.prefix_store_min_tokens,
        )  # fmt: skip

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
            self._check_embedding(params)
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
        return RequestHandle(request.request_id, request.sink, self._cancel, self._drop)

    def _start_restore(self, request: Request, pending: PendingRestore) -> None:
        """Under the lock: hand ``request``'s stored prefix to the restore thread."""
        assert self._restorer is not None  # a pending restore comes only from the store
        self._restoring.add(request.request_id)
        self._restorer.submit(self._restore, request, pending)

    def _restore(self, request: Request, pending: PendingRestore) -> None:
        """On the restore thread: read ``request``'s stored prefix into its own cells
        without the lock (the engine thread steps the others meanwhile; this one it neither
        steps nor reaps), then commit it under the lock: all of it, or, if the file fails a
        check or the request was cancelled meanwhile (the read stops at its next part),
        none (it is bound as without the file). A request the engine ended meanwhile (its
        loop failed) stays ended."""
        assert self.prefix is not None
        try:
            read = self.prefix.read(pending, stop=request.cancelled.is_set)
        except Exception:  # a read that fails commits nothing: computed instead
            log.exception("reading a stored prefix failed; computed instead")
            read = False
        with self._lock:
            self._restoring.discard(request.request_id)
            if request.state != "done":
                try:
                    self._admission.finish_restore(request, pending, read)
                except Exception:
                    log.exception("committing a stored prefix failed; ending its request")
                    self._end(request, "error")
            self._lock.notify_all()

    @property
    def embeds(self) -> bool:
        """Whether this engine's executor gives final hidden states (embedding requests)."""
        executor = self._stepper.executor
        return isinstance(executor, HiddenStates) and executor.embeds

    def _check_embedding(self, params: SamplingParams) -> None:
        if params.max_new_tokens != 0:
            raise ValueError(
                f"an embedding request generates nothing: max_new_tokens must be 0, "
                f"not {params.max_new_tokens}"
            )
        if not self.embeds:
            raise ValueError(
                "this model cannot embed: its executor gives no final hidden states (a "
                "bundle's final norm lives in its program)"
            )

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
        atexit.unregister(self._close_at_exit)
        with self._lock:
            self._admission.closing = True
            running = [] if drain else list(self._admission.running.values())
            for request in [*self._admission.queue, *running]:
                if request.timings.cancel_requested is None:
                    request.timings.cancel_requested = self.clock()
                request.cancelled.set()
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine did not stop within %ss", timeout)
            return
        if self._restorer is not None:
            self._restorer.shutdown(wait=True)  # a read the failed loop left (none, else)
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
        # Outside the lock: the pool's storage never moves, and reading the page map of a
        # large pool takes a few milliseconds that no step should wait for.
        resident = self.pool.resident_bytes
        with self._lock:
            running = list(self._admission.running.values())
            usage = self.pool.usage()
            counters = self.counters
            return EngineStats(
                slots_in_use=len(running),
                max_seqs=self.config.max_seqs,
                sessions_by_class=dict(Counter(r.priority for r in running)),
                sessions_by_state=dict(
                    Counter("prefill" if r.in_prefill else "decode" for r in running)
                    + Counter(queued=len(self._admission.queue))
                ),
                kv_blocks_free=usage.free,
                kv_blocks_used=usage.used,
                kv_pool_bytes=self.pool.nbytes,
                queue_len=len(self._admission.queue),
                admitted=counters.admitted,
                finished=dict(counters.finished),
                refusals=dict(counters.refusals),
                cancellations=counters.cancellations,
                steps=sum(counters.steps_by_batch_size.values()),
                steps_by_batch_size=dict(counters.steps_by_batch_size),
                steps_by_class=dict(counters.steps_by_class),
                pressure_level=None if self.pressure is None else self.pressure.reading(),
                prefix=self._prefix_stats(),
                cancel_bound=self.cancel_bound(),
                kv_resident_bytes=resident,
                kv_blocks_parked=usage.parked,
                slots_parked=self.pool.parked_slots,
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
        """Time the largest step this config allows on the engine's own pool, before it
        serves (`slotserve.engine.probe.largest_step`), and count it as a measured step of
        that size, so the declared bound (`cancel_bound`: ``/slots``, ``/metrics``, the
        dashboard) has seconds from the start (`slotserve serve` calls it). It allocates
        nothing beyond the plan: the pool is the engine's and the step is the plan's
        largest. Only while no session is bound, under the engine lock, on a thread of its
        own; the sessions it reserves are released and the KV it writes is never read. The
        bound unchanged when sessions are bound or the pool cannot hold that step's
        sessions at ``max_context``. What the step leaves beyond the KV pages it wrote is
        one-time state: with ``budget_scope="process"`` it joins the ledger's runtime arena
        (`PlanError` if the budget then does not hold the plan)."""
        executor, pool = self._stepper.executor, self.pool
        with self._lock:
            if pool.sessions:
                return self.cancel_bound()
            trim_heap()  # what earlier work freed must not offset what the step keeps
            meter = self.ledger.meter("the largest step")
            kv_before = pool.resident_bytes
            try:
                tokens, (seconds, _) = on_own_thread(
                    lambda: largest_step(self.model, self.config, executor, pool)
                )
            except KVExhausted:
                return self.cancel_bound()
            finally:
                for session in list(pool.sessions):
                    pool.release(session)
                trim_heap()  # the step's freed activations leave before the server is ready
            # The KV pages the step wrote are the pool's arena, not start state.
            kv_written = pool.resident_bytes - kv_before
            if self.config.budget_scope == "process":
                meter.mark("runtime", extra=-kv_written)
                self.plan.check()
            self.counters.count_step_time(tokens, seconds)
            return self.cancel_bound()

    def _prefix_stats(self) -> PrefixStats | None:
        if self.prefix is None:
            return None
        counters = self.prefix.stats
        return PrefixStats(
            budget_bytes=self.prefix.budget_bytes,
            hits=counters.hits,
            misses=counters.misses,
            rejections=counters.rejections,
            rejections_by_rule=dict(counters.rejections_by_rule),
            tokens_restored=counters.tokens_restored,
            bytes_pinned=self.prefix.bytes_pinned,
            snapshots=len(self.prefix),
            evictions=counters.evictions,
            store=None if self.prefix.store is None else store_stats(self.prefix.store.report()),
        )

    def slots(self) -> list[SlotView]:
        """Each slot of the pool: idle, or the request it serves (state, class, tokens, age)."""
        now = self.clock()
        with self._lock:
            by_slot = {self.pool.slot_of(r.request_id): r for r in self._admission.running.values()}
            return [_slot_view(i, by_slot.get(i), now) for i in range(self.config.max_seqs)]

    def pool_view(self) -> PoolView:
        """The KV pool's occupancy and exactly which blocks and rows each running request
        (by request id) and each prefix-cache snapshot holds, read from the pool's own
        tables in one go under the engine lock."""
        with self._lock:
            usage = self.pool.usage()
            held = self.pool.holdings()
            return PoolView(
                layout=self.config.kv_layout,
                unit="blocks" if held.block_size is not None else "rows",
                total=usage.free + usage.used,
                used=usage.used,
                free=usage.free,
                nbytes=self.pool.nbytes,
                block_size=held.block_size,
                row_groups=held.row_groups,
                sessions=held.sessions,
                snapshots=held.snapshots,
            )

    def check_integrity(self) -> None:
        """Pool and admission invariants (every running request bound in the pool)."""
        with self._lock:
            self.pool.check_integrity()
            self._admission.check_integrity()
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
                work = self._scheduler.select(ready, self._max_batch())
                if not work:
                    self._trim_when_idle()
                    self._lock.wait(IDLE_WAIT_S)
                    continue
                self._idle_since, self._trimmed = None, False
                try:
                    return work, self._commit(work)
                except Exception:  # a step the pool refuses ends its requests, not the engine
                    log.exception("step refused by the KV pool; ending its requests")
                    for request, _ in work:
                        self._end(request, "error")

    def _trim_when_idle(self) -> None:
        """Once the engine has had nothing to step for `IDLE_TRIM_S` since its last step,
        give the heap's free pages back (once a pause). Under the lock: a request submitted
        meanwhile waits the trim's few milliseconds."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._trimmed and now - self._idle_since >= IDLE_TRIM_S:
            trim_heap()
            self._trimmed = True

    def _max_batch(self) -> int:
        max_seqs = self.config.max_seqs
        return max(1, max_seqs // 2) if self._under_pressure() else max_seqs

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
            finished = self._stepper.run(work, batch)
        except Exception:  # a failing step ends its requests, never the engine
            log.exception("step failed; ending its %d requests", len(work))
            finished = [(request, "error") for request, _ in work]
        seconds = self.clock() - began
        with self._lock:
            tokens = sum(n for _, n in work)
            self.counters.count_step(len(work), work[0][0].priority, seconds, tokens)
            failed = {id(r) for r, reason in finished if reason == "error"}
            self._publish([r for r, _ in work if id(r) not in failed])
            for request, reason in finished:
                self._end(request, reason)

    def _publish(self, stepped: list[Request]) -> None:
        """Under the lock, before anything is released: offer the prompt of each request
        whose opening prefill just completed (in a step that did not fail) to the cache."""
        if self.prefix is None:
            return
        for request in stepped:
            if not request.published and not request.in_prefill and request.state == "running":
                request.published = True
                self.prefix.publish(request.request_id, request.prompt)

    def _clear_prefix(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    def _end(self, request: Request, reason: FinishReason) -> None:
        """Release the slot and KV first, then send the terminal event."""
        if request.state == "done":
            return
        # A parked slot costs nothing, so a flat pool keeps every generation's KV (as
        # llama.cpp's slots keep their last prompt); elsewhere only what was asked for.
        parks = self.pool.parks_slots and request.pooling is None
        keep = reason != "error" and (request.publish_completion or parks)
        self._admission.release(request, keep=keep)
        now = self.clock()
        request.timings.released = now
        self.counters.finished[reason] += 1
        if reason == "cancelled":
            self.counters.cancellations += 1
            latency = request.timings.cancel_to_release
            if latency is not None:
                self.counters.cancel_seconds.append(latency)
        finished = request.finish(reason, now, "the step failed" if reason == "error" else None)
        request.released.set()
        if self.on_finished is not None:
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
                if request.timings.cancel_requested is None:
                    request.timings.cancel_requested = self.clock()
                request.cancelled.set()
        for request in list(self._admission.running.values()):
            if request.cancelled.is_set() and request.request_id not in self._restoring:
                self._end(request, "cancelled")  # (one being restored: once it is)
        for request, outcome in self._admission.take_leaving(self.clock()):
            if outcome == "cancelled":
                self._end(request, "cancelled")
            else:
                self._refuse_queued(request, outcome)

    def _refuse_queued(self, request: Request, reason: str) -> None:
        request.state = "done"
        request.timings.released = self.clock()
        request.sink.put(self._admission.refusal(reason))
        request.released.set()

    def _fail_all(self) -> None:
        """After the loop died: close, end running requests with an error, refuse the queue."""
        with self._lock:
            self._admission.closing = True
            for request in list(self._admission.running.values()):
                self._end(request, "error")
            for request, _ in self._admission.take_leaving(self.clock()):
                self._refuse_queued(request, "closed")
            self._clear_prefix()


def _exit_closer(engine_ref: weakref.ref[Engine]) -> Callable[[], None]:
    """An atexit hook that closes the engine if it still lives (holding no reference)."""

    def close_at_exit() -> None:
        engine = engine_ref()
        if engine is not None:
            engine.close(timeout=EXIT_CLOSE_TIMEOUT_S)

    return close_at_exit


def _slot_view(slot: int, request: Request | None, now: float) -> SlotView:
    if request is None:
        return SlotView(slot)
    return SlotView(
        slot,
        "prefill" if request.in_prefill else "decode",
        request.request_id,
        request.priority,
        len(request.prompt),
        len(request.generated),
        round(now - request.timings.submitted, 3),
    )


def _within_step_limit(config: EngineConfig, limit: int | None) -> EngineConfig:
    """``config`` with steps no larger than the executor takes (a lowered program's size):
    a smaller step only splits prefill into smaller chunks. Every running sequence must still
    fit in one decode step, so ``max_seqs`` above the limit is refused."""
    if limit is None or config.max_batch_tokens <= limit:
        return config
    if config.max_seqs > limit:
        raise ValueError(
            f"max_seqs={config.max_seqs} exceeds the {limit} tokens a step of this executor "
            f"takes (its program was lowered for {limit}); use max_seqs <= {limit} or export "
            "again with a larger --max-batch-tokens"
        )
    log.info(
        "max_batch_tokens %d -> %d: the executor's largest step", config.max_batch_tokens, limit
    )
    return dataclasses.replace(
        config, max_batch_tokens=limit, prefill_chunk=min(config.prefill_chunk, limit)
    )
