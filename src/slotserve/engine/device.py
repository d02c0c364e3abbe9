"""`DeviceScheduler`: whose step runs next on the device, across the engines of a model set.

The kernels own every core for a step (one OpenMP team), so two engines stepping at once
would oversubscribe them. Each engine of a served set therefore takes a *turn* before each
step (`turn`), declaring the class of the step it is about to run; one turn is held at a
time, and when it ends the next goes by the rules a single engine's `Scheduler` applies
within one model:

- the highest class waiting goes first (``interactive``, ``normal``, ``background``),
  first come first served within a class;
- ``background`` is guaranteed ``background_min_share`` of the device *time* it competes
  for, and takes no more: a deficit in seconds (each contended turn's measured length
  times the share, less the contended background turns' lengths) grants background a turn
  when it is owed time, but never two turns in a row while an interactive step waits: an
  interactive step waits behind at most one background step of another model;
- after a turn above ``background`` ends, the device is held for that class for as long as
  the turn took: an engine stepping in a loop takes its next turn within that gap, so
  background does not slip into every gap between its steps (a background turn the share
  owes goes at once; one that comes once the hold has lapsed is not contended);
- a turn below ``interactive`` should last about as long as an interactive step
  (`turn_budget_s`): an engine whose steps can be cut (the encoder's batches) cuts them to
  that, so the time an interactive step waits behind one is bounded, and the share counts
  time in turns of comparable length. Where no step above its class waits and none has run
  for `IDLE_AFTER_S` (no turn of a user's is under way), it may last up to
  ``idle_turn_s``, so that background work nobody waits for is not cut into steps too small
  to run its products well; ``idle_turn_s`` is the longest the first step of a newly
  arriving request waits behind it.

Pure policy over member names, classes and the turns' measured lengths: it never touches an
engine, tensors or the KV pool. Owns: the turn, its waiters, the background deficit and
the counters that prove the rules (`check_integrity`). Must not touch: what a step computes
or which requests it holds.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from slotserve.engine.events import PRIORITIES, Priority
from slotserve.native import release_team

DEFAULT_DEVICE_BACKGROUND_SHARE = 0.1
# How often a `TurnTaker` with nothing to step looks again.
IDLE_POLL_S = 0.002
# The longest a turn below interactive may last while no step above it is under way
# (`DeviceScheduler.turn_budget_s`), and how long after the last step above background
# that holds (a turn of a user's is under way until then).
DEFAULT_IDLE_TURN_S = 0.05
IDLE_AFTER_S = 0.25
# How fast the typical interactive turn's length (`DeviceScheduler.turn_budget_s`) follows
# newer turns (the weight an older turn keeps per turn).
TURN_DECAY = 0.9
log = logging.getLogger("slotserve")


@dataclass
class DeviceCounters:
    """What the device scheduler granted: ``turns`` by member, ``turns_by_class``, their
    measured ``seconds_by_class``, the most background turns granted in a row while an
    interactive step of another member waited (``max_background_ahead_of_interactive``;
    the rules keep it at most 1), the seconds of contended turns (``contended_s``: a
    background turn while another class waited or held the device, or another class's
    turn while background waited) and background's part of them
    (``contended_background_s``; the rules keep it within the share plus one turn)."""

    turns: dict[str, int] = field(default_factory=dict)
    turns_by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITIES, 0))
    seconds_by_class: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(PRIORITIES, 0.0)
    )
    max_background_ahead_of_interactive: int = 0
    contended_s: float = 0.0
    contended_background_s: float = 0.0


@dataclass(frozen=True)
class _Waiter:
    member: str
    priority: Priority
    arrival: int


class DeviceScheduler:
    """One turn at a time across engines (module docstring). Thread-safe: every engine's
    loop thread calls `turn`. ``clock``: what measures a turn's length (seconds)."""

    def __init__(
        self,
        background_min_share: float = DEFAULT_DEVICE_BACKGROUND_SHARE,
        clock: Callable[[], float] = time.monotonic,
        idle_turn_s: float = DEFAULT_IDLE_TURN_S,
    ) -> None:
        if not 0.0 <= background_min_share < 1.0:
            raise ValueError(
                f"background_min_share={background_min_share} not in [0, 1); "
                "e.g. 0.1 gives background one turn in ten it competes for"
            )
        self.background_min_share = background_min_share
        self.clock = clock
        self.idle_turn_s = idle_turn_s
        self.counters = DeviceCounters()
        self._cond = threading.Condition()
        self._holder: _Waiter | None = None
        self._waiting: list[_Waiter] = []
        self._granted: _Waiter | None = None  # chosen, not yet taken by its thread
        self._arrivals = itertools.count()
        # Seconds of device time background is owed (positive) or ahead (negative).
        self._background_credit = 0.0
        self._last_class: Priority | None = None
        self._background_run = 0  # background turns in a row while interactive waited
        self._began = 0.0  # when the holder's turn was granted
        self._contended = False  # whether the holder's turn counts toward the share
        self._hold_until = float("-inf")  # the device is kept for the classes above background
        self._longest_turn_s = 0.0
        self._interactive_turn_s: float | None = None
        self._above_ended = float("-inf")  # when the last turn above background ended

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
                self._cond.wait(self._wait_s())
                self._grant_next()  # a hold may have lapsed
            self._granted = None
            self._holder = me
            self._began = self.clock()

    def release(self, member: str) -> None:
        """End ``member``'s turn and grant the next one."""
        with self._cond:
            holder = self._holder
            assert holder is not None and holder.member == member, (
                f"{member!r} released a turn it does not hold ({holder})"
            )
            now = self.clock()
            self._account(holder.priority, max(now - self._began, 0.0))
            if holder.priority != "background":
                self._hold_until = now + (now - self._began)
                self._above_ended = now
            self._holder = None
            self._grant_next()
            if self._granted is None and self._waiting:
                self._cond.notify_all()  # held: the waiters wait again, until it lapses

    def turn_budget_s(self, priority: Priority) -> float | None:
        """How long a turn of class ``priority`` should take at most: for a class below
        ``interactive``, about one interactive turn (the recent interactive turns' length)
        while a step above it waits or one above background ran within `IDLE_AFTER_S`,
        else up to ``idle_turn_s``; None for ``interactive`` itself or before any
        interactive turn has run."""
        with self._cond:
            turn = self._interactive_turn_s
            if priority == "interactive" or turn is None:
                return None
            return turn if self._above_active(priority) else max(turn, self.idle_turn_s)

    def above_active(self, priority: Priority) -> bool:
        """Whether work above class ``priority`` waits for the device or ran within
        `IDLE_AFTER_S` (never for ``interactive``): a turn of ``priority`` is then cut to
        one interactive turn, a step of it that can stop between its parts stops at the
        next, and its model lets go of its threads after it."""
        with self._cond:
            return priority != "interactive" and self._above_active(priority)

    def _above_active(self, priority: Priority) -> bool:
        rank = PRIORITIES.index(priority)
        waits = any(PRIORITIES.index(w.priority) < rank for w in self._waiting)
        return waits or self.clock() - self._above_ended < IDLE_AFTER_S

    def _account(self, priority: Priority, seconds: float) -> None:
        """Under the lock, as a turn ends: its length into the counters, the typical
        interactive turn, and, for a contended turn, background's deficit (the share of
        the turn's time, less the turn itself when it was background's; never more than
        the longest turn banked)."""
        counters = self.counters
        counters.seconds_by_class[priority] += seconds
        self._longest_turn_s = max(self._longest_turn_s, seconds)
        if priority == "interactive":
            last = self._interactive_turn_s
            self._interactive_turn_s = (
                seconds if last is None else TURN_DECAY * last + (1 - TURN_DECAY) * seconds
            )
        if not self._contended:
            return
        counters.contended_s += seconds
        credit = self._background_credit + self.background_min_share * seconds
        if priority == "background":
            counters.contended_background_s += seconds
            credit -= seconds
        self._background_credit = min(credit, self._longest_turn_s)

    def _hold_left(self) -> float | None:
        """Under the lock: seconds until the hold for the classes above background lapses
        (None: no hold, wait to be woken)."""
        left = self._hold_until - self.clock()
        return left if left > 0 else None

    def _wait_s(self) -> float | None:
        """Under the lock, for a waiter `_grant_next` did not grant: None (until a release
        or a grant wakes it) while a turn is held or granted; else the device was kept
        free for the classes above background, and the seconds until that hold lapses, 0
        where it has lapsed since `_grant_next` read the clock (a waiter that slept until
        woken then would wait for a release that may never come)."""
        if self._holder is not None or self._granted is not None:
            return None
        return max(self._hold_until - self.clock(), 0.0)

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
        classes = {w.priority for w in self._waiting}
        held = self._hold_left() is not None
        if classes == {"background"} and held and self._background_credit <= 0.0:
            return  # kept for the class above that just stepped (`_hold_left` wakes them)
        chosen = self._pick_class(classes)
        waiter = min((w for w in self._waiting if w.priority == chosen), key=lambda w: w.arrival)
        self._waiting.remove(waiter)
        if chosen == "background":
            self._contended = held or classes != {"background"}
        else:
            self._contended = "background" in classes
            self._hold_until = float("-inf")
        self._count(waiter)
        self._granted = waiter
        self._cond.notify_all()

    def _pick_class(self, classes: set[Priority]) -> Priority:
        best = next(c for c in PRIORITIES if c in classes)
        if "background" in classes and best != "background" and self._background_credit > 0.0:
            # Never two background turns in a row ahead of a waiting interactive step: a
            # turn that rule withholds stays owed (`_account` banks at most one turn).
            after_background = self._last_class == "background" and best == "interactive"
            if not after_background:
                return "background"
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
        step; background's deficit stays within one turn either way, so its contended time
        is at most its share of the contended time plus one turn."""
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
            longest, share = self._longest_turn_s, self.background_min_share
            slack = 1e-9 * (1.0 + self.counters.contended_s)  # float sums' rounding
            assert -longest - slack <= self._background_credit <= longest + slack, (
                f"background's deficit {self._background_credit}s outside one turn ({longest}s)"
            )
            counters = self.counters
            assert (
                counters.contended_background_s <= share * counters.contended_s + longest + slack
            ), (
                f"background took {counters.contended_background_s}s of "
                f"{counters.contended_s}s contended, over its share {share} plus one turn"
            )


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
    of its next step (None: nothing to step), one step of at most ``budget_s`` seconds
    where its steps can be cut (None: a whole step; with ``yield_when``, ``budget_s``
    bounds each part of the step between two points where it stops once
    ``yield_when()`` is true), and whether it is closed."""

    def next_class(self) -> Priority | None: ...

    def step(
        self, budget_s: float | None = None, yield_when: Callable[[], bool] | None = None
    ) -> bool: ...

    @property
    def closed(self) -> bool: ...


class TurnTaker:
    """Steps a `Steppable` engine on the device: a thread that, whenever the engine has
    work, takes a turn of that work's class at ``seat`` and runs one step within the turn's
    budget (`DeviceScheduler.turn_budget_s`), which stops at its next cut while a class above
    it waits or has just run (`DeviceScheduler.above_active`). Ends when the engine is
    closed (or `stop`)."""

    def __init__(self, engine: Steppable, seat: DeviceSeat) -> None:
        self.engine, self.seat = engine, seat
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"slotserve-turns-{seat.member}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        stepped = False
        while not self._stop.is_set():
            priority = self.engine.next_class()
            if priority is None:
                if self.engine.closed:
                    self.engine.step()  # reap what the close cancelled
                    return
                if stepped:
                    # Idle: end the OpenMP team its steps started on this thread. Another
                    # model's team beside it would put more threads than cores under
                    # libgomp, whose waits then stop spinning, and every parallel region
                    # of that model's steps would wait for a sleeping thread to wake.
                    release_team()
                    stepped = False
                self._stop.wait(IDLE_POLL_S)
                continue
            stepped = True
            scheduler = self.seat.scheduler
            try:
                with self.seat.turn(priority):
                    self.engine.step(
                        scheduler.turn_budget_s(priority),
                        functools.partial(scheduler.above_active, priority),
                    )
                    if scheduler.above_active(priority):
                        # Work above this turn's class has the device next: end this
                        # thread's team now, within the turn (its threads must be gone
                        # before the next turn's first parallel region), for the reason
                        # above, rather than when this engine idles.
                        release_team()
                        stepped = False
            except Exception:  # the engine ends a failed step's requests; keep serving
                log.exception("step of %s failed", self.seat.member)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
