"""`OrderedLock`: a lock with a rank in the one order every thread takes locks in.

Two threads that each hold one lock and wait for the other's deadlock, so every lock that
slotserve's threads share has a rank, and a thread takes a lock only while every lock it
holds ranks below it. The order, lowest first (docs/ARCHITECTURE.md, "Threads and locks"):

- ``engine`` (`ENGINE`): the engine's state, its pool and its prefix cache;
- ``prefix store`` (`PREFIX_STORE`): the disk tier's index and counters;
- ``write ticket`` (`WRITE_TICKET`): one snapshot's write, between the cache and the writer.

A lock that is none of these (an event queue's, a thread pool's) is a leaf: nothing is
taken while it is held. A weakref finalizer or any other code a garbage-collection pass may
run takes none of them (`slotserve.engine.handle`): it runs on whatever thread the pass
happens on, with whatever that thread holds.

With checking on (``SLOTSERVE_LOCK_CHECK=1`` in the environment, or `check_lock_order`; the
test suite turns it on), each blocking acquisition is checked against the locks the thread
holds, and one that inverts the order raises `LockOrderError` naming both, at the
acquisition that could deadlock rather than at a deadlock that a test may never hit; it is
also recorded (`lock_order_violations`), so an inversion on a thread whose errors are
logged and swallowed still fails the test. A non-blocking acquisition cannot deadlock and
is not checked. Off, an `OrderedLock` is the lock it wraps and one flag test.
"""

from __future__ import annotations

import os
import threading
from typing import Any

ENGINE = 10
PREFIX_STORE = 20
WRITE_TICKET = 30

_checking = os.environ.get("SLOTSERVE_LOCK_CHECK", "") not in ("", "0")
_held = threading.local()
_violations: list[str] = []


class LockOrderError(RuntimeError):
    """A thread took a lock while holding one of equal or higher rank (`OrderedLock`)."""


def check_lock_order(on: bool) -> None:
    """Turn the order check on or off (at a moment when no `OrderedLock` is held)."""
    global _checking
    _checking = on


def lock_order_violations() -> list[str]:
    """Every inversion found since the last `clear_lock_order_violations` (a copy)."""
    return list(_violations)


def clear_lock_order_violations() -> None:
    _violations.clear()


def _stack() -> list[OrderedLock]:
    stack: list[OrderedLock] | None = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


class OrderedLock:
    """A lock (reentrant with ``reentrant``) of ``rank`` in the order above, named ``name``
    in errors; usable as a context manager and under a `threading.Condition`."""

    def __init__(self, name: str, rank: int, *, reentrant: bool = False) -> None:
        self.name, self.rank, self.reentrant = name, rank, reentrant
        self._lock: Any = threading.RLock() if reentrant else threading.Lock()

    def __repr__(self) -> str:
        return f"OrderedLock({self.name!r}, rank {self.rank})"

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if _checking and blocking:
            self._check()
        got: bool = self._lock.acquire(blocking, timeout)
        if got and _checking:
            _stack().append(self)
        return got

    def release(self) -> None:
        if _checking:
            stack = _stack()
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _check(self) -> None:
        for held in _stack():
            if held is self and self.reentrant:
                continue
            if held is self or held.rank >= self.rank:
                problem = (
                    f"thread {threading.current_thread().name!r} takes the {self.name} lock "
                    f"(rank {self.rank}) while holding the {held.name} lock (rank {held.rank})"
                )
                _violations.append(problem)
                raise LockOrderError(problem)

    # What `threading.Condition` uses of a lock, so that a wait releases it entirely.

    def _is_owned(self) -> bool:
        if self.reentrant:
            return bool(self._lock._is_owned())
        if self._lock.acquire(False):
            self._lock.release()
            return False
        return True

    def _release_save(self) -> tuple[Any, int]:
        stack = _stack()
        depth = sum(1 for held in stack if held is self)
        stack[:] = [held for held in stack if held is not self]
        if self.reentrant:
            return self._lock._release_save(), depth
        self._lock.release()
        return None, depth

    def _acquire_restore(self, saved: tuple[Any, int]) -> None:
        state, depth = saved
        if _checking:
            self._check()
        if self.reentrant:
            self._lock._acquire_restore(state)
        else:
            self._lock.acquire()
        if _checking:
            _stack().extend([self] * max(depth, 1))
