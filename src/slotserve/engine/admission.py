"""`Admission`: who runs and who waits.

It owns the running set (each request bound to a pool session with its whole worst-case
reservation), the bounded queue with deadlines, re-admission from the queue, and refusals
by reason, and the end of each request (`end`: release, then its terminal event).
`build_request` turns a submit call into a checked `Request` (or refuses one
that can never fit the context). The engine calls every `Admission` method under its lock.
With ``defer_store``, a request bound to be restored from the prefix store is bound with a
fresh reservation and its `PendingRestore` comes back, for the engine to read without the
lock and to finish (`finish_restore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from slotserve.engine.config import EngineConfig
from slotserve.engine.events import PRIORITIES, Finished, FinishReason, Priority
from slotserve.engine.request import Request
from slotserve.engine.sink import EventSink
from slotserve.engine.timings import EngineCounters, RequestTimings
from slotserve.errors import AdmissionRefused, KVExhausted
from slotserve.kv.pool import KVPool
from slotserve.model import Model
from slotserve.prefix import PendingRestore, PrefixCache
from slotserve.sampling import RequestSampler, SamplingParams, StopMatcher


def check_embedding(params: SamplingParams, embeds: bool) -> None:
    """`ValueError` unless an embedding request can run: it generates nothing, on an
    executor that gives final hidden states (``embeds``)."""
    if params.max_new_tokens != 0:
        raise ValueError(
            f"an embedding request generates nothing: max_new_tokens must be 0, "
            f"not {params.max_new_tokens}"
        )
    if not embeds:
        raise ValueError(
            "this model cannot embed: its executor gives no final hidden states (a "
            "bundle's final norm lives in its program)"
        )


def build_request(
    request_id: int,
    model: Model,
    config: EngineConfig,
    prompt: str | list[int],
    params: SamplingParams,
    priority: Priority,
    now: float,
) -> Request:
    """Tokenise and check a request against the context; raises `ValueError` for bad
    input and `AdmissionRefused("context_too_long")` for a request that cannot fit."""
    tokenizer, vocab_size, max_context = model.tokenizer, model.info.vocab_size, config.max_context
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"prompt token ids must be in 0..{vocab_size - 1}")
    needed = len(tokens) + params.max_new_tokens
    if needed > max_context:
        raise AdmissionRefused(
            "context_too_long",
            f"prompt of {len(tokens)} tokens + max_new_tokens={params.max_new_tokens} = "
            f"{needed} exceeds max_context={max_context}; shorten the prompt or lower "
            f"max_new_tokens to at most {max(max_context - len(tokens), 0)}",
        )
    eos = frozenset() if params.ignore_eos else frozenset(tokenizer.eos_ids)
    return Request(
        request_id=request_id,
        prompt=tokens,
        params=params,
        priority=priority,
        sampler=RequestSampler(params, vocab_size, tokens),
        decoder=tokenizer.stream_decoder(),
        stops=StopMatcher(params.stop, params.min_tokens),
        eos_ids=eos,
        sink=EventSink(),
        timings=RequestTimings(submitted=now),
    )


class Admission:
    """The running set and the queue of one engine, over its pool.

    Invariants (`check_integrity`): running requests are exactly the pool's sessions and
    are ``running``; queued requests are ``queued``, carry a deadline and number at most
    ``queue_depth``; nothing is both running and queued.
    """

    def __init__(
        self,
        config: EngineConfig,
        pool: KVPool,
        counters: EngineCounters,
        clock: Callable[[], float],
        under_pressure: Callable[[], bool],
        prefix: PrefixCache | None = None,
    ) -> None:
        self.config, self.pool, self.counters = config, pool, counters
        self.clock, self.under_pressure = clock, under_pressure
        self.prefix = prefix
        self.running: dict[int, Request] = {}
        self.queue: list[Request] = []
        self.closing = False

    @property
    def idle(self) -> bool:
        return not self.running and not self.queue

    def admit(
        self, request: Request, may_queue: bool, *, defer_store: bool = False
    ) -> PendingRestore | None:
        """Bind ``request`` now, or queue it (``may_queue`` and room in the queue), or
        raise `AdmissionRefused` with the reason (counted). With ``defer_store``, a request
        bound to be restored from the prefix store comes back with its `PendingRestore`
        (`PrefixCache.bind_deferring`), to read and `finish_restore`."""
        reason = self._blocker(request)
        if reason == "closed":
            self.refuse(reason)
        if reason is None and not self._queue_ahead_of(request.priority):
            try:
                return self._bind(request, defer_store)
            except KVExhausted:
                reason = "kv_exhausted"
        if not may_queue or self.config.queue_depth == 0:
            self.refuse(reason or "slots_full")
        if len(self.queue) >= self.config.queue_depth:
            self.refuse("queue_full")
        request.deadline = self.clock() + self.config.queue_timeout_s
        self.queue.append(request)
        return None

    def refuse(self, reason: str) -> NoReturn:
        """Count a refusal and raise it."""
        raise self.refusal(reason)

    def refusal(self, reason: str) -> AdmissionRefused:
        """A counted `AdmissionRefused` with the message that explains ``reason``."""
        self.counters.refusals[reason] += 1
        return AdmissionRefused(reason, self._message(reason))

    def readmit(self) -> list[tuple[Request, PendingRestore]]:
        """Bind queued requests in class order, then arrival order; stop at the first that
        cannot be bound, so a large request is not starved by smaller ones behind it. Those
        bound to be restored from the prefix store come back with their `PendingRestore`
        (read without the lock, as at submit: a disk read never holds the step loop)."""
        pending: list[tuple[Request, PendingRestore]] = []
        for request in sorted(self.queue, key=lambda r: PRIORITIES.index(r.priority)):
            if self._blocker(request) is not None:
                if request.priority == "background":
                    continue  # paused by pressure: others may still go
                break
            try:
                restore = self._bind(request, defer_store=True)
            except KVExhausted:
                break
            self.queue.remove(request)
            if restore is not None:
                pending.append((request, restore))
        return pending

    def take_leaving(self, now: float) -> list[tuple[Request, str]]:
        """Remove and return the queued requests that leave without running: cancelled
        (``"cancelled"``), past their deadline (``"queue_timeout"``, or ``"pressure"`` for
        background work that device pressure still holds back) or closed out (``"closed"``)."""
        leaving: list[tuple[Request, str]] = []
        for request in list(self.queue):
            if request.cancelled.is_set() and not self.closing:
                leaving.append((request, "cancelled"))
            elif self.closing:
                leaving.append((request, "closed"))
            elif request.deadline is not None and now >= request.deadline:
                leaving.append((request, self._expiry_reason(request)))
            else:
                continue
            self.queue.remove(request)
        return leaving

    def release(self, request: Request, keep: bool = False) -> None:
        """Unbind a running request: its slot and KV go back to the pool. With ``keep``
        (and the prefix cache), the KV it committed, prompt then completion, is handed to
        the cache as a snapshot instead (`PrefixCache.release_into`)."""
        if self.running.pop(request.request_id, None) is None:
            return
        if keep and self.prefix is not None:
            committed = self.pool.length(request.request_id)
            tokens = [*request.prompt, *request.generated][:committed]
            self.prefix.release_into(request.request_id, tokens)
        else:
            self.pool.release(request.request_id)

    def end(self, request: Request, reason: FinishReason) -> Finished | None:
        """Release a running request's slot and KV, count its end, then send its terminal
        event and mark it released; returns the event (None if it had already ended)."""
        if request.state == "done":
            return None
        # A parked slot costs nothing, so a flat pool keeps every generation's KV (as
        # llama.cpp's slots keep their last prompt); elsewhere only what was asked for.
        parks = self.pool.parks_slots and request.pooling is None
        self.release(request, keep=reason != "error" and (request.publish_completion or parks))
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
        return finished

    def publish_prompts(self, stepped: list[Request]) -> None:
        """After a step, before anything is released: offer the prompt of each request whose
        opening prefill just completed (in a step that did not fail) to the prefix cache."""
        if self.prefix is None:
            return
        for request in stepped:
            if not request.published and not request.in_prefill and request.state == "running":
                request.published = True
                self.prefix.publish(request.request_id, request.prompt)

    def refuse_queued(self, request: Request, reason: str) -> None:
        """End a queued request that leaves unbound (expired, closed out): its refusal."""
        request.state = "done"
        request.timings.released = self.clock()
        request.sink.put(self.refusal(reason))
        request.released.set()

    def check_integrity(self) -> None:
        assert set(self.running) == self.pool.session_ids(), "running ≠ pool sessions"
        assert all(r.state == "running" for r in self.running.values()), "running state"
        assert all(r.state == "queued" and r.deadline is not None for r in self.queue), "queued"
        assert len(self.queue) <= self.config.queue_depth, "queue over its depth"
        queued = {r.request_id for r in self.queue}
        assert len(queued) == len(self.queue), "a request queued twice"
        assert not queued & set(self.running), "a request both queued and running"
        assert len(self.running) <= self.config.max_seqs, "more sessions than max_seqs"

    def _expiry_reason(self, request: Request) -> str:
        """Why a queued request ran out of time: the pressure that paused it, if that is
        still what holds it back, else the queue's deadline."""
        paused = request.priority == "background" and self.under_pressure()
        return "pressure" if paused else "queue_timeout"

    def _queue_ahead_of(self, priority: Priority) -> bool:
        """Whether a queued request of the same or a higher class waits already."""
        rank = PRIORITIES.index(priority)
        return any(PRIORITIES.index(r.priority) <= rank for r in self.queue)

    def _blocker(self, request: Request) -> str | None:
        """Why ``request`` cannot be bound now, KV aside (None: it can try)."""
        if self.closing:
            return "closed"
        if request.priority == "background" and self.under_pressure():
            return "pressure"
        if len(self.running) >= self.config.max_seqs:
            return "slots_full"
        return None

    def _bind(self, request: Request, defer_store: bool = False) -> PendingRestore | None:
        """Reserve the slot and the whole worst-case KV (raises KVExhausted, the request
        unchanged). With the prefix cache, the longest usable prefix is restored into the
        request's session (it then prefills only the rest), and the cache evicts snapshots
        before the pool refuses; with ``defer_store``, a restore from the store is left to
        read (its `PendingRestore`)."""
        pending = None
        if self.prefix is None:
            self.pool.reserve(request.request_id, request.reservation)
        elif request.pooling in ("mean", "cls"):  # a pooled row is never restored
            self.prefix.bind(request.request_id, (), request.reservation)
        else:
            pending = self._bind_restoring(request, self.prefix, defer_store)
        request.state = "running"
        request.timings.admitted = self.clock()
        self.running[request.request_id] = request
        self.counters.admitted += 1
        return pending

    def _bind_restoring(
        self, request: Request, prefix: PrefixCache, defer_store: bool
    ) -> PendingRestore | None:
        """Bind through the cache, timing the lookup and restoration: the prefill span
        starts here, so restoration is never left out of it."""
        began = self.clock()
        session, tokens, n_tokens = request.request_id, request.prompt, request.reservation
        pending = None
        if defer_store and prefix.store is not None:
            restored, pending = prefix.bind_deferring(session, tokens, n_tokens)
        else:
            restored = prefix.bind(session, tokens, n_tokens)
        timings = request.timings
        timings.restore_started = began
        timings.restore_time = self.clock() - began
        timings.prompt_tokens_restored = restored
        request.prefilled = restored
        return pending

    def finish_restore(self, request: Request, pending: PendingRestore, read: bool) -> None:
        """After ``pending`` was read (``read``: whether the file checked out): commit it
        (`PrefixCache.finish`) and time the restoration from the admission's start, so
        the read is inside the prefill span."""
        assert self.prefix is not None
        restored = self.prefix.finish(pending, read)
        timings = request.timings
        began = timings.restore_started
        assert began is not None  # set when it was bound
        timings.restore_time = self.clock() - began
        timings.prompt_tokens_restored = restored
        request.prefilled = restored

    def _message(self, reason: str) -> str:
        config = self.config
        return {
            "closed": "the engine is closed",
            "pressure": "the device is under pressure; background work is paused",
            "slots_full": f"all {config.max_seqs} slots (max_seqs) are in use",
            "kv_exhausted": "the KV pool cannot hold this request's worst case now",
            "queue_full": f"the admission queue is full ({config.queue_depth} waiting)",
            "queue_timeout": f"no slot freed within queue_timeout_s={config.queue_timeout_s}",
        }[reason]
