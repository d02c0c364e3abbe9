"""`RequestHandle`: the caller's side of a request.

Iterate it (blocking, or ``async for``) for `TokenEvent`s and then exactly one `Finished`.
``cancel()`` returns at once; ``cancel(wait=True)`` waits for the engine to release the
slot and KV and returns a `CancelAck`. A handle dropped without cancel is reclaimed by the
engine the same way: its weakref finalizer calls ``drop``, which only records the id for the
engine thread (the engine holds no reference to the handle). A finalizer runs on whatever
thread a garbage-collection pass happens on, maybe one that holds another lock (the prefix
store's writer, in its index), so it must take no lock and run no engine code.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from slotserve.engine.events import CancelAck, Event, Finished, TokenEvent
from slotserve.engine.sink import EventSink
from slotserve.engine.timings import RequestTimings
from slotserve.errors import AdmissionRefused


class RequestHandle:
    def __init__(
        self,
        request_id: int,
        sink: EventSink,
        cancel: Callable[[int, bool, float | None], CancelAck | None],
        drop: Callable[[int], None],
        timings: RequestTimings | None = None,
    ) -> None:
        self.request_id = request_id
        # The request's timings as the engine thread fills them in: a live reading, whole
        # once the request has finished (then also `Finished.timings`).
        self.timings = timings
        self._sink = sink
        self._cancel = cancel
        self.finished: Finished | None = None
        self.refused: AdmissionRefused | None = None
        self._finalizer = weakref.finalize(self, drop, request_id)

    def _take(self, item: Any) -> Event:
        if isinstance(item, AdmissionRefused):
            self.refused = item
            self._finalizer.detach()
            raise item
        if isinstance(item, Finished):
            self.finished = item
            self._finalizer.detach()
        assert isinstance(item, TokenEvent | Finished)
        return item

    def __iter__(self) -> Iterator[Event]:
        while self.finished is None:
            if self.refused is not None:
                raise self.refused
            yield self._take(self._sink.get())

    async def __aiter__(self) -> AsyncIterator[Event]:
        while self.finished is None:
            if self.refused is not None:
                raise self.refused
            yield self._take(await self._sink.aget())

    def result(self) -> Finished:
        """Block until the request ends; its `Finished` event (full text and tokens)."""
        for _ in self:
            pass
        assert self.finished is not None
        return self.finished

    def cancel(self, wait: bool = False, timeout: float | None = 10.0) -> CancelAck | None:
        """Stop the request at the next batch boundary. Idempotent. With ``wait``, block
        until its slot and KV are released and return the measured latency."""
        return self._cancel(self.request_id, wait, timeout)
