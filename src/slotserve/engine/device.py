"""`DeviceScheduler`: whose step runs next on the device, across the engines of a model set.

The kernels own every core for a step (one OpenMP team), so two engines stepping at once
would oversubscribe them. Each engine of a served set therefore takes a *turn* before each
step (`turn`), declaring the class of the step it is about to run; one turn is held at a
time, and when it ends the next goes by the rules a single engine's `Scheduler` applies
within one model:

- the highest class waiting goes first (``interactive``, ``normal``, ``background``),
  first come first served within a class;
- ``background`` is guaranteed ``background_min_share`` of the turns it competes for
  (deficit round robin, as `Scheduler.pick_class`), but never two turns in a row while an
  interactive step waits: an interactive step waits behind at most one background step of
  another model.

Pure policy over member names and classes: it never touches an engine, tensors or the KV
pool. Owns: the turn, its waiters and the counters that prove the rules
(`check_integrity`). Must not touch: what a step computes or which requests it holds.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from slotserve.engine.events import PRIORITIES, Priority

DEFAULT_DEVICE_BACKGROUND_SHARE = 0.1
# How often a `TurnTaker` with nothing to step looks again.
IDLE_POLL_S = 0.002
log = logging.getLogger("slotserve")


@dataclass
class DeviceCounters:
    """What the device scheduler granted: ``turns`` by member, ``turns_by_class``, and the
    most background turns granted in a row while an interactive step of another member
    waited (``max_background_ahead_of_interactive``; the rules keep it at most 1)."""

    turns: dict[str, int] = field(default_factory=dict)
    turns_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITIES, 0))
    max_background_ahead_of_interactive: int = 0


@dataclass(frozen=True)
class _Waiter:
    member: str
    priority: Priority
    arrival: int


class DeviceScheduler:
    """One turn at a time across engines (module docstring). Thread-safe: every engine's
    loop thread calls `turn`."""

    def __init__(self, background_min_share: float = DEFAULT_DEVICE_BACKGROUND_SHARE) -> None:
        if not 0.0 <= background_min_share < 1.0:
            raise ValueError(
                f"background_min_share={background_min_share} not in [0, 1); "
                "e.g. 0.1 gives background one turn in ten it competes for"
            )
        self.background_min_share = background_min_share
        self.counters = DeviceCounters()
        self._cond = threading.Condition()
        self._holder: _Waiter | None = None
        self._waiting: list[_Waiter] = []
        self._granted: _Waiter | None = None  # chosen, not yet taken by its thread
        self._arrivals = itertools.count()
        self._background_credit = 0.0
        self._last_class: Priority | None = None
        self._background_run = 0  # background turns in a row while interactive waited

    @contextmanager
    def turn(self, member: str, priority: Priority) -> Iterator[None]:
        """Hold the device for one step of ``member`` of class ``priority``; blocks until
        the rules grant it."""
        self.acquire(member, priority)
        try:
            yield
        finally:
            self.release(member)

    def acquire(self, member: str, priority: Priority) -> None:
        """Wait for, then take, ``member``'s turn (`turn` is the usual spelling)."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority={priority!r} is not one of {PRIORITIES}")
        with self._cond:
            me = _Waiter(member, priority, next(self._arrivals))
            self._waiting.append(me)
            self._grant_next()
            while self._granted is not me:
                self._cond.wait()
            self._granted = None
            self._holder = me

    def release(self, member: str) -> None:
        """End ``member``'s turn and grant the next one."""
        with self._cond:
            assert self._holder is not None and self._holder.member == member, (
                f"{member!r} released a turn it does not hold ({self._holder})"
            )
            self._holder = None
            self._grant_next()

    @property
    def waiting(self) -> list[tuple[str, Priority]]:
        """The members waiting for a turn, with their classes, in arrival order."""
        with self._cond:
            return [(w.member, w.priority) for w in self._waiting]

    @property
    def holder(self) -> str | None:
        with self._cond:
            return None if self._holder is None else self._holder.member

    def _grant_next(self) -> None:
        """Under the lock: when the device is free and nobody is granted, pick the next
        waiter by the rules and wake it."""
        if self._holder is not None or self._granted is not None or not self._waiting:
            return
        chosen = self._pick_class({w.priority for w in self._waiting})
        waiter = min((w for w in self._waiting if w.priority == chosen), key=lambda w: w.arrival)
        self._waiting.remove(waiter)
        self._count(waiter)
        self._granted = waiter
        self._cond.notify_all()

    def _pick_class(self, classes: set[Priority]) -> Priority:
        best = next(c for c in PRIORITIES if c in classes)
        share = self.background_min_share
        if "background" in classes and best != "background" and share > 0:
            self._background_credit += share
            # Never two background turns in a row ahead of a waiting interactive step.
            after_background = self._last_class == "background" and best == "interactive"
            if self._background_credit >= 1.0 - 1e-9 and not after_background:
                self._background_credit -= 1.0
                return "background"
            # A turn the rule above withholds is owed, but no more than one is banked: a
            # share above one half cannot be paid while interactive steps keep waiting.
            self._background_credit = min(self._background_credit, 1.0)
        return best

    def _count(self, waiter: _Waiter) -> None:
        counters = self.counters
        counters.turns[waiter.member] = counters.turns.get(waiter.member, 0) + 1
        counters.turns_by_class[waiter.priority] += 1
        interactive_waits = any(
            w.priority == "interactive" and w.member != waiter.member for w in self._waiting
        )
        if waiter.priority == "background" and interactive_waits:
            self._background_run += 1
        elif waiter.priority == "interactive" or not interactive_waits:
            self._background_run = 0
        counters.max_background_ahead_of_interactive = max(
            counters.max_background_ahead_of_interactive, self._background_run
        )
        self._last_class = waiter.priority

    def check_integrity(self) -> None:
        """One holder at most; a granted waiter is neither waiting nor holding; waiters are
        distinct; background never ran two turns in a row ahead of a waiting interactive
        step."""
        with self._cond:
            arrivals = [w.arrival for w in self._waiting]
            assert len(set(arrivals)) == len(arrivals), "a waiter is queued twice"
            if self._granted is not None:
                assert self._granted not in self._waiting, "granted and still waiting"
                assert self._holder is None, "granted while another holds the device"
            assert self.counters.max_background_ahead_of_interactive <= 1, (
                "an interactive step waited behind "
                f"{self.counters.max_background_ahead_of_interactive} background steps"
            )
            assert 0.0 <= self._background_credit < 1.0 + self.background_min_share


@dataclass(frozen=True)
class DeviceSeat:
    """An engine's place at a `DeviceScheduler`: its ``member`` name there. The engine
    takes `turn` around each step it runs."""

    scheduler: DeviceScheduler
    member: str

    def turn(self, priority: Priority) -> AbstractContextManager[None]:
        return self.scheduler.turn(self.member, priority)


class Steppable(Protocol):
    """An engine a caller steps (an encoder engine built with ``start=False``): the class
    of its next step (None: nothing to step), one step, and whether it is closed."""

    def next_class(self) -> Priority | None: ...

    def step(self) -> bool: ...

    @property
    def closed(self) -> bool: ...


class TurnTaker:
    """Steps a `Steppable` engine on the device: a thread that, whenever the engine has
    work, takes a turn of that work's class at ``seat`` and runs one step. Ends when the
    engine is closed (or `stop`)."""

    def __init__(self, engine: Steppable, seat: DeviceSeat) -> None:
        self.engine, self.seat = engine, seat
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"slotserve-turns-{seat.member}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            priority = self.engine.next_class()
            if priority is None:
                if self.engine.closed:
                    self.engine.step()  # reap what the close cancelled
                    return
                self._stop.wait(IDLE_POLL_S)
                continue
            try:
                with self.seat.turn(priority):
                    self.engine.step()
            except Exception:  # the engine ends a failed step's requests; keep serving
                log.exception("step of %s failed", self.seat.member)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
