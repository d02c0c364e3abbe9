"""`EventSink`: a thread-safe event queue that a blocking or an asyncio consumer can read."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any


class EventSink:
    """The engine thread `put`s; one consumer reads with `get` (blocking) or `aget`."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._ready = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def put(self, item: Any) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that consumer's event loop is closed: nobody to wake
                continue

    def get(self, timeout: float | None = None) -> Any:
        with self._ready:
            if not self._ready.wait_for(lambda: bool(self._items), timeout):
                raise TimeoutError("no event within the timeout")
            return self._items.popleft()

    async def aget(self) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            with self._ready:
                if self._items:
                    return self._items.popleft()
                future: asyncio.Future[None] = loop.create_future()
                waiter = (loop, future)
                self._waiters.append(waiter)
            try:
                await future
            finally:  # a cancelled consumer must not leave a waiter behind
                with self._ready:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
