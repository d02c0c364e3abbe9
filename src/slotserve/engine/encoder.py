"""`EncoderEngine`: embedding requests on an encoder model, admitted against a memory plan,
batched by priority class, cancellable at every batch boundary.

It is the encoder's counterpart of `Engine`, without a KV pool: a request is a list of
texts; admission binds all of its texts to text slots (``max_texts``, whose memory
`plan_encoder` counted) or queues it (bounded, with a deadline) or refuses it with a typed
reason; a step embeds up to ``max_batch_texts`` texts of one class (`Scheduler.pick_class`:
interactive first, background its minimum share), longest first, and, when its caller gives
it a time budget (a device scheduler bounding a turn, `DeviceScheduler.turn_budget_s`), only
the whole texts that its own fit of seconds per token and layer (`StepCost`) says fit that
budget, at least one: a batch then runs as several short steps, each a device turn of its
own, with the same embeddings (`EncoderModel.embed` is batch-invariant). Where even the
first text does not fit the budget, the step runs only the layers of it that fit (at least
one) and the engine holds the forward (`EncoderPass`, within the plan's `held_bytes`) for
its next steps to run the rest: one held forward at most, continued when the scheduler
picks its class, while another class's steps (whole texts) go between its layers. A
caller that can say when other work waits (``yield_when``, a device scheduler's turn-taker)
gets steps whose budget bounds each layer rather than the whole step: such a step runs the
texts whose one layer fits the budget through all their layers, and stops between two
layers (holding the forward) as soon as ``yield_when()`` is true, so that a waiting request
of another class or model waits at most one layer while large steps keep the products
efficient. A held forward of several texts whose one layer no longer fits the (shorter)
budget of a later step gives its texts back, to be embedded again by steps that fit: a
large step composed while nothing above was active is not continued layer by layer beside
a user's turn. A request ends with one `EmbeddingResult` once all of its texts are embedded.
A cancel (or a dropped handle) ends the request at the next batch boundary and releases its
slots, acknowledged with the measured latency; its texts in a running step are discarded,
and a forward it holds between layers is released at that boundary.

Two ways to drive it. With ``start=True`` (the default) it runs its own step thread, as
`Engine` does. With ``start=False`` a caller steps it (`step`): a multi-model server whose
device scheduler picks the next step across models by `next_class`, or a test. Either way
`submit`, `cancel` and the readers are thread-safe; every method that changes state takes
the engine's lock (rank `ENGINE`), and the model runs outside it, so a submit never waits
for a step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from slotserve.engine.config import EngineConfig
from slotserve.engine.encoder_plan import EncoderConfig, EncoderPlan, plan_encoder
from slotserve.engine.encoder_request import (
    EmbeddingEnd,
    EmbeddingHandle,
    EmbeddingRequest,
    EmbeddingTimings,
)
from slotserve.engine.events import PRIORITIES, CancelAck, Priority, check_priority
from slotserve.engine.scheduler import Scheduler
from slotserve.engine.step_cost import StepCost
from slotserve.errors import AdmissionRefused
from slotserve.locks import ENGINE, OrderedLock
from slotserve.memory import MemoryLedger
from slotserve.model.encoder import EncoderModel, EncoderPass, EncoderScratch
from slotserve.native import release_team, torch_on_cores

log = logging.getLogger("slotserve")

IDLE_WAIT_S = 0.05  # how often an idle step thread looks at queue deadlines


@dataclass(frozen=True)
class EncoderStats:
    """A reading of the engine: text slots in use, requests running and queued, refusals by
    reason, ends by reason, steps (by class), texts embedded and the bytes of the forward it
    holds between layers."""

    max_texts: int
    texts_in_use: int
    running: int
    queue_len: int
    steps: int
    texts_embedded: int
    cancellations: int
    held_bytes: int  # a forward held between layers (`EncoderPass.nbytes`; 0: none)
    refusals: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    steps_by_class: dict[str, int] = field(default_factory=dict)


@dataclass
class _Step:
    """A step's texts: (request, indices) pairs in batch order, their token ids and class,
    the ``layers`` its next model call runs, and, once a call has run some of them but not
    all, the forward under way (``forward``)."""

    parts: list[tuple[EmbeddingRequest, list[int]]]
    texts: list[list[int]]
    priority: Priority
    layers: int
    forward: EncoderPass | None = None
    may_yield: bool = False  # whether it may stop between layers, to be held

    @property
    def tokens(self) -> int:
        return sum(len(text) for text in self.texts)

    def outgrows(self, units: int) -> bool:
        """Whether one layer of it, of several texts, costs more than ``units``."""
        return len(self.texts) > 1 and self.tokens > units


class EncoderEngine:
    """Serves ``model`` (an `EncoderModel`) under ``config`` (module docstring). The
    memory plan (`plan_encoder`) runs here and adds to ``ledger`` (default: the model's
    load's): a `PlanError` refuses to start."""

    def __init__(
        self,
        model: EncoderModel,
        config: EncoderConfig | None = None,
        *,
        ledger: MemoryLedger | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.model = model
        self.config = config or EncoderConfig()
        self.plan: EncoderPlan
        self.plan, self.ledger = plan_encoder(model, self.config, ledger)
        self.clock = clock
        lock: Any = OrderedLock("encoder engine", ENGINE, reentrant=True)
        self._lock = threading.Condition(lock)
        self._scheduler = Scheduler(
            EngineConfig(background_min_share=self.config.background_min_share)
        )
        self._ids = itertools.count()
        self._known: weakref.WeakValueDictionary[int, EmbeddingRequest] = (
            weakref.WeakValueDictionary()
        )
        self._running: dict[int, EmbeddingRequest] = {}
        self._queue: list[EmbeddingRequest] = []
        self._dropped: deque[int] = deque()
        self._texts_in_use = 0
        self._stepping: _Step | None = None  # the step whose model call is under way
        self._held: _Step | None = None  # a forward split by layer, between its calls
        self._scratch = EncoderScratch()  # its steps' widest products, kept while busy
        self._team = False  # whether its steps' OpenMP team may be alive (`_idle`)
        self._closing = False
        self._steps = 0
        self._texts_embedded = 0
        self._cancellations = 0
        self._refusals: Counter[str] = Counter()
        self._finished: Counter[str] = Counter()
        self._steps_by_class: Counter[str] = Counter()
        # Seconds of a model call by its tokens times the layers it runs, fitted to the calls.
        self._cost = StepCost()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._loop, name="slotserve-encoder", daemon=True
            )
            self._thread.start()

    # -- caller API (any thread) -----------------------------------------------------

    def submit(
        self,
        texts: str | Sequence[str],
        priority: str = "normal",
        *,
        may_queue: bool = False,
    ) -> EmbeddingHandle:
        """Admit the embedding of ``texts`` (one string or a list) in class ``priority``;
        with ``may_queue``, wait in the bounded queue when there is no room now. Raises
        `ValueError` for an empty list or an unknown class, `AdmissionRefused` when it
        cannot run (``batch_too_large``: more texts than ``max_texts``; ``slots_full``,
        ``queue_full``, ``closed``). Texts past the model's ``max_seq_len`` tokens are
        truncated, as sentence-transformers truncates them."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not batch:
            raise ValueError("the input is empty: give at least one text to embed")
        if not all(isinstance(text, str) for text in batch):
            raise ValueError("every input must be a string")
        klass = check_priority(priority)
        tokens = self.model.tokenize(batch)  # outside the lock: tokenising is the caller's
        with self._lock:
            request = EmbeddingRequest(
                request_id=next(self._ids),
                texts=tokens,
                priority=klass,
                timings=EmbeddingTimings(submitted=self.clock()),
                dim=self.model.info.dim,
            )
            self._admit(request, may_queue)
            self._known[request.request_id] = request
            self._lock.notify_all()
        return EmbeddingHandle(request.request_id, request.sink, self._cancel, self._drop)

    def embed(self, texts: str | Sequence[str], priority: str = "normal") -> torch.Tensor:
        """``submit`` then wait: the ``[n_texts, dim]`` embeddings (needs the step thread)."""
        result = self.submit(texts, priority).result()
        if result.reason != "stop":
            raise RuntimeError(f"the embedding request ended {result.reason}: {result.error}")
        return result.embeddings

    def next_class(self) -> Priority | None:
        """The class the next step would serve (None: nothing to step), for a device
        scheduler choosing across models; it does not advance the background share."""
        with self._lock:
            classes = {r.priority for r in self._running.values() if r.ready}
            if self._held is not None:
                classes.add(self._held.priority)
            return next((c for c in PRIORITIES if c in classes), None)

    def step(
        self, budget_s: float | None = None, yield_when: Callable[[], bool] | None = None
    ) -> bool:
        """Reap cancels and expired waits, re-admit from the queue, then run one batch step
        (the model outside the lock) and commit it; False when there was nothing to step.
        ``budget_s``: the seconds the step should take at most; it embeds the whole texts
        that fit by the engine's fitted cost per token and layer, at least one, or, where
        one does not fit, runs the layers of one text that fit, at least one (None: up to
        ``max_batch_texts`` whole texts, or the rest of a held forward). With ``yield_when``
        and a budget, the budget bounds one layer of the step, and the step stops between
        two layers once ``yield_when()`` is true (the module doc). One caller steps at a
        time: the engine's own thread, or the caller that built it with ``start=False``."""
        by_layer = yield_when is not None and budget_s is not None
        with self._lock:
            self._reap()
            step = self._next_step(self._budget_units(budget_s), by_layer)
            if step is None:
                self._idle()
                return False
            if step is self._held:
                self._held = None  # the call's own until it ends
            self._stepping = step
        began = time.perf_counter()
        forward: EncoderPass | None = None
        rows: torch.Tensor | None = None
        error = None
        try:
            # The step's OpenMP team is kept for the next step, and ended once idle
            # (`_idle`) or by a device scheduler's turn-taker when another model needs
            # the cores.
            self._team = True
            forward, rows, ran = torch_on_cores(
                lambda: self._compute(step, yield_when), release=False
            )
            self._cost.observe(ran, time.perf_counter() - began)
        except Exception as exc:  # a failed step ends its requests, not the engine
            log.exception("encoder step failed; ending its requests")
            forward, error = None, f"the step failed: {exc}"
        with self._lock:
            self._stepping = None
            self._steps += 1
            self._steps_by_class[step.priority] += 1
            if forward is not None and rows is None:
                step.forward = forward
                self._held = step
            else:
                self._commit(step, rows, error)
            self._reap()
            self._lock.notify_all()
        return True

    def _idle(self) -> None:
        """Under the lock, on the stepping thread, with nothing to step: let go of the
        steps' scratch and end their OpenMP team (`release_team`)."""
        self._scratch.clear()
        if self._team:
            release_team()
            self._team = False

    def _compute(
        self, step: _Step, yield_when: Callable[[], bool] | None
    ) -> tuple[EncoderPass, torch.Tensor | None, int]:
        """The model call of ``step``: its forward after ``step.layers`` more layers (fewer
        where it may yield and ``yield_when()`` turned true after one), the embedding rows
        once it has run them all (else None), and the tokens times layers it ran (the cost
        fit's unit)."""
        forward = step.forward or self.model.start(step.texts)
        done = forward.layers_done
        if yield_when is None or not step.may_yield:
            forward = self.model.advance(forward, step.layers, self._scratch)
        else:
            end = done + step.layers
            forward = self.model.advance(forward, 1, self._scratch)
            while forward.layers_done < end and not yield_when():
                forward = self.model.advance(forward, 1, self._scratch)
        rows = (
            self.model.finish(forward) if forward.layers_done == self.model.info.n_layers else None
        )
        return forward, rows, forward.tokens * (forward.layers_done - done)

    def close(self, timeout: float = 60.0) -> None:
        """Stop admitting; refuse queued requests (``closed``) and cancel running ones at
        the next batch boundary; wait for the step thread. Every text slot is free after."""
        with self._lock:
            self._closing = True
            for request in [*self._queue, *self._running.values()]:
                request.cancel(self.clock())
            self._lock.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("encoder engine did not stop within %ss", timeout)
        else:
            with self._lock:
                self._reap()

    def __enter__(self) -> EncoderEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closing

    def stats(self) -> EncoderStats:
        """A reading of the engine (`EncoderStats`)."""
        with self._lock:
            return EncoderStats(
                max_texts=self.config.max_texts,
                texts_in_use=self._texts_in_use,
                running=len(self._running),
                queue_len=len(self._queue),
                steps=self._steps,
                texts_embedded=self._texts_embedded,
                cancellations=self._cancellations,
                held_bytes=self._held_bytes(),
                refusals=dict(self._refusals),
                finished=dict(self._finished),
                steps_by_class=dict(self._steps_by_class),
            )

    def check_integrity(self) -> None:
        """Text slots in use are exactly the running requests' texts, within ``max_texts``;
        running requests are ``running``, queued ones ``queued`` with a deadline, within
        ``queue_depth``, none both; no text is both pending and embedded; a step's texts are
        out of pending only in a running step or in the held forward, whose texts are its
        parts', part way through its layers, in the plan's ``held_bytes``; the steps'
        scratch is within the plan's step; the ledger holds."""
        with self._lock:
            running = self._running.values()
            assert self._texts_in_use == sum(r.n_texts for r in running), "slots ≠ texts"
            assert self._texts_in_use <= self.config.max_texts, "slots over max_texts"
            assert all(r.state == "running" for r in running), "running state"
            assert all(r.state == "queued" and r.deadline is not None for r in self._queue)
            assert len(self._queue) <= self.config.queue_depth, "queue over its depth"
            queued = {r.request_id for r in self._queue}
            assert len(queued) == len(self._queue), "a request queued twice"
            assert not queued & set(self._running), "a request both queued and running"
            held = self._held
            holding = {} if held is None else {id(r): i for r, i in held.parts}
            for r in running:
                assert r.embedded + len(r.pending) + len(r.in_step) == r.n_texts, "texts lost"
                assert self._stepping is not None or r.in_step == holding.get(id(r), []), (
                    "a step's texts outside a step"
                )
            if held is not None:
                self._check_held(held)
            assert self._scratch.nbytes <= self.plan.step_bytes, (
                f"the scratch's {self._scratch.nbytes} bytes exceed the plan's step "
                f"({self.plan.step_bytes})"
            )
            self.ledger.check_integrity()

    def _check_held(self, held: _Step) -> None:
        """Under the lock: the held forward is its parts' texts, part way through, within
        the plan."""
        forward = held.forward
        assert forward is not None, "a step held without its forward"
        assert self._stepping is not held, "the held forward is also the running step's"
        assert 0 < forward.layers_done < self.model.info.n_layers, "held before or after"
        assert [len(t) for t in held.texts] == forward.batch.lengths.tolist(), "held texts"
        assert sum(len(i) for _, i in held.parts) == len(held.texts), "held parts"
        assert all(r.state == "running" for r, _ in held.parts), "a held text's request ended"
        assert forward.nbytes <= self.plan.held_bytes, (
            f"the held forward's {forward.nbytes} bytes exceed the plan's {self.plan.held_bytes}"
        )

    def _held_bytes(self) -> int:
        forward = None if self._held is None else self._held.forward
        return 0 if forward is None else forward.nbytes

    # -- admission (under the lock) --------------------------------------------------

    def _admit(self, request: EmbeddingRequest, may_queue: bool) -> None:
        config = self.config
        if self._closing:
            self._refuse("closed")
        if request.n_texts > config.max_texts:
            self._refuse(
                "batch_too_large",
                f"{request.n_texts} texts are more than this encoder admits at once "
                f"(max_texts={config.max_texts}); send at most {config.max_texts} texts a "
                "request, or start the engine with a larger max_texts",
            )
        if self._fits(request) and not self._queue_ahead_of(request.priority):
            self._bind(request)
            return
        if not may_queue or config.queue_depth == 0:
            self._refuse("slots_full")
        if len(self._queue) >= config.queue_depth:
            self._refuse("queue_full")
        request.deadline = self.clock() + config.queue_timeout_s
        self._queue.append(request)

    def _refuse(self, reason: str, message: str | None = None) -> NoReturn:
        raise self._refusal(reason, message)

    def _refusal(self, reason: str, message: str | None = None) -> AdmissionRefused:
        self._refusals[reason] += 1
        config = self.config
        default = {
            "closed": "the encoder engine is closed",
            "slots_full": (
                f"{self._texts_in_use} of max_texts={config.max_texts} text slots are in "
                "use; retry later, or submit with may_queue=True"
            ),
            "queue_full": f"the admission queue is full ({config.queue_depth} waiting)",
            "queue_timeout": f"no room freed within queue_timeout_s={config.queue_timeout_s}",
        }
        return AdmissionRefused(reason, message or default[reason])

    def _fits(self, request: EmbeddingRequest) -> bool:
        return self._texts_in_use + request.n_texts <= self.config.max_texts

    def _queue_ahead_of(self, priority: Priority) -> bool:
        rank = PRIORITIES.index(priority)
        return any(PRIORITIES.index(r.priority) <= rank for r in self._queue)

    def _bind(self, request: EmbeddingRequest) -> None:
        request.state = "running"
        request.timings.admitted = self.clock()
        self._running[request.request_id] = request
        self._texts_in_use += request.n_texts

    def _readmit(self) -> None:
        """Bind queued requests in class order, then arrival order, stopping at the first
        that does not fit (a large request is not starved by smaller ones behind it)."""
        for request in sorted(self._queue, key=lambda r: PRIORITIES.index(r.priority)):
            if not self._fits(request):
                break
            self._queue.remove(request)
            self._bind(request)

    # -- the step (under the lock) ---------------------------------------------------

    def _budget_units(self, budget_s: float | None) -> int | None:
        """The tokens times layers a step of ``budget_s`` seconds runs by the cost fit (None:
        no bound; 0, one layer of one text: before any step has been timed, or a budget
        within the fit's fixed cost of a step, whatever the fit's slope)."""
        if budget_s is None:
            return None
        if self._cost.n == 0:
            return 0
        fixed, per_unit = self._cost.line()
        if budget_s <= fixed:
            return 0
        if per_unit <= 0.0:  # the steps timed so far do not grow with their work
            return None
        return int((budget_s - fixed) / per_unit)

    def _layers(self, tokens: int, units: int | None, left: int) -> int:
        """How many of the ``left`` layers of a forward of ``tokens`` tokens fit ``units``
        (at least one)."""
        return left if units is None else min(left, max(1, units // tokens))

    def _next_step(self, units: int | None, by_layer: bool) -> _Step | None:
        """The held forward's next layers when the scheduler picks its class (``fifo``:
        always), else a new step of the chosen class (`_compose`). ``by_layer``: ``units``
        bound one layer of the step, which runs every layer left unless it yields."""
        step = self._choose(units, by_layer)
        if step is not None and by_layer:
            step.may_yield = self._held is None or step is self._held
            if step.may_yield:  # else a step beside a held forward: whole, as composed
                step.layers = self.model.info.n_layers - (
                    0 if step.forward is None else step.forward.layers_done
                )
        return step

    def _choose(self, units: int | None, by_layer: bool) -> _Step | None:
        held = self._held
        if by_layer and held is not None and units is not None and held.outgrows(units):
            # Composed under a longer budget (nothing above was active) and stopped when a
            # turn above arrived: a layer of it would hold the device past the budget now,
            # so its texts go back to be embedded again in steps that fit (the same bits:
            # the forward is deterministic).
            for request, _ in held.parts:
                request.abandon_step()
            self._held = held = None
        ready = sorted((r for r in self._running.values() if r.ready), key=lambda r: r.request_id)
        if self.config.policy == "isolate":
            chosen = self._scheduler.pick_class([*ready, *([held] if held else [])])
            if held is not None and chosen == held.priority:
                return self._continue(held, units)
            ready = [r for r in ready if r.priority == chosen]
        elif held is not None:
            return self._continue(held, units)
        if not ready:
            return None
        return self._compose(ready, units, 1 if by_layer and held is None else None)

    def _continue(self, held: _Step, units: int | None) -> _Step:
        assert held.forward is not None
        left = self.model.info.n_layers - held.forward.layers_done
        held.layers = self._layers(held.tokens, units, left)
        return held

    def _compose(
        self, ready: list[EmbeddingRequest], units: int | None, fit_layers: int | None
    ) -> _Step:
        """A new step of ``ready`` (one class, or every class under ``fifo``): up to
        ``max_batch_texts`` whole texts, longest first, whose ``fit_layers`` layers (None:
        all) fit ``units`` (at least one text); where the first alone does not, the layers
        of it that fit. While a forward is held a step is never split (one held forward at
        most)."""
        n_layers = self.model.info.n_layers
        fit = fit_layers or n_layers
        room = self.config.max_batch_texts
        parts: list[tuple[EmbeddingRequest, list[int]]] = []
        units_left = units
        for request in ready:
            n, full = 0, False
            for i in request.pending[:room]:
                cost = len(request.texts[i]) * fit
                if units_left is not None and cost > units_left and (parts or n):
                    full = True  # the budget is spent; the first text always goes
                    break
                n += 1
                if units_left is not None:
                    units_left -= cost
            if n:
                indices = request.take(n)
                if request.timings.first_step is None:
                    request.timings.first_step = self.clock()
                parts.append((request, indices))
                room -= n
            if full or room == 0:
                break
        texts = [request.texts[i] for request, indices in parts for i in indices]
        step = _Step(parts, texts, ready[0].priority, n_layers)
        if self._held is None:
            step.layers = self._layers(step.tokens, units, n_layers)
        return step

    def _commit(self, step: _Step, rows: torch.Tensor | None, error: str | None) -> None:
        """Hand each request its rows (a cancelled one's are discarded); end those done."""
        offset = 0
        for request, indices in step.parts:
            share = rows[offset : offset + len(indices)] if rows is not None else None
            offset += len(indices)
            if request.state != "running":
                continue
            if share is None:
                request.abandon_step()
                self._end(request, "error", error)
            elif request.cancelled.is_set():
                request.abandon_step()
            else:
                request.commit(share)
                self._texts_embedded += len(indices)
                if not request.pending:
                    self._end(request, "stop")

    def _end(
        self, request: EmbeddingRequest, reason: EmbeddingEnd, error: str | None = None
    ) -> None:
        """Release a running request's text slots, then send its result."""
        if self._running.pop(request.request_id, None) is None:
            return
        self._texts_in_use -= request.n_texts
        request.state = "done"
        request.timings.released = self.clock()
        self._finished[reason] += 1
        if reason == "cancelled":
            self._cancellations += 1
        request.sink.put(request.result(reason, error))
        request.released.set()

    def _release_held(self) -> None:
        """Release the held forward when a request of its texts was cancelled (or ended):
        its texts go back to their requests' pending texts (a cancelled request's are never
        stepped again). Not while a step runs: the forward is that step's until it ends."""
        held = self._held
        if held is None or self._stepping is not None:
            return
        if all(r.state == "running" and not r.cancelled.is_set() for r, _ in held.parts):
            return
        for request, _ in held.parts:
            request.abandon_step()
        self._held = None

    def _leave_queue(self, request: EmbeddingRequest, reason: str) -> None:
        self._queue.remove(request)
        request.state = "done"
        request.timings.released = self.clock()
        if reason == "cancelled":
            self._cancellations += 1
            self._finished["cancelled"] += 1
            request.sink.put(request.result("cancelled"))
        else:
            request.sink.put(self._refusal(reason))
        request.released.set()

    def _reap(self) -> None:
        """At a batch boundary: cancel dropped handles' requests, release a held forward
        with a cancelled request's texts, end cancelled running ones (their texts in a running step
        are discarded at its commit), take cancelled,
        closed-out and expired requests off the queue, then re-admit."""
        while self._dropped:
            dropped = self._known.get(self._dropped.popleft())
            if dropped is not None:
                dropped.cancel(self.clock())
        now = self.clock()
        for request in list(self._queue):
            if request.cancelled.is_set() and not self._closing:
                self._leave_queue(request, "cancelled")
            elif self._closing:
                self._leave_queue(request, "closed")
            elif request.deadline is not None and now >= request.deadline:
                self._leave_queue(request, "queue_timeout")
        self._release_held()
        for request in list(self._running.values()):
            if request.cancelled.is_set() and not request.in_step:
                self._end(request, "cancelled")
        if not self._closing:
            self._readmit()

    # -- threads -----------------------------------------------------------------------

    def _drop(self, request_id: int) -> None:
        """A handle collected without cancel: only its id is noted (no lock; a finalizer
        may run anywhere); the next batch boundary cancels it."""
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
        if self._thread is None:
            raise RuntimeError("cancel(wait=True) needs the step thread (start=True)")
        if not request.released.wait(timeout):
            raise TimeoutError(f"request {request_id} was not released within {timeout}s")
        return CancelAck(request.timings.cancel_to_release or 0.0)

    def _loop(self) -> None:
        try:
            while True:
                if not self.step():
                    with self._lock:
                        if self._closing and not self._running and not self._queue:
                            return
                        ready = any(r.ready for r in self._running.values())
                        if not self._dropped and not ready and self._held is None:
                            self._lock.wait(IDLE_WAIT_S)
        except BaseException:
            log.exception("encoder loop failed; ending every request")
            with self._lock:
                self._closing = True
                self._held = None
                for request in list(self._running.values()):
                    request.abandon_step()
                    self._end(request, "error", "the encoder's step loop failed")
                for request in list(self._queue):
                    self._leave_queue(request, "closed")
