"""`Restorer`: the engine's restore thread, which reads stored prefixes off the step loop.

A request bound to be restored from the prefix store (by `Engine.submit`, or re-admitted
from the queue) is handed here under the engine lock (`start`). The read itself
(`PrefixCache.read`, into the request's own fresh reservation) runs on this thread without
the lock, so the engine thread steps the others meanwhile; while it runs the request is in
``restoring`` and the engine neither steps nor reaps it. A cancel stops the read at its next
part. The read's outcome is then committed under the lock (`Admission.finish_restore`): all
of the prefix, or none (the request is bound as without the file).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from slotserve.engine.admission import Admission
from slotserve.engine.events import FinishReason
from slotserve.engine.request import Request
from slotserve.prefix import PendingRestore, PrefixCache

log = logging.getLogger("slotserve")


class Restorer:
    """One thread reading stored prefixes for ``prefix``; ``lock`` is the engine's
    condition, taken to commit a read into ``admission`` and notified after; ``end`` ends a
    request whose commit fails (the engine's, under the lock)."""

    def __init__(
        self,
        prefix: PrefixCache,
        lock: threading.Condition,
        admission: Admission,
        end: Callable[[Request, FinishReason], None],
    ) -> None:
        self._prefix, self._lock, self._admission, self._end = prefix, lock, admission, end
        self.restoring: set[int] = set()  # request ids being read; under the engine lock
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="slotserve-restore")

    def start(self, request: Request, pending: PendingRestore) -> None:
        """Under the engine lock: read ``request``'s stored prefix on this thread."""
        self.restoring.add(request.request_id)
        self._thread.submit(self._restore, request, pending)

    def _restore(self, request: Request, pending: PendingRestore) -> None:
        try:
            read = self._prefix.read(pending, stop=request.cancelled.is_set)
        except Exception:  # a read that fails commits nothing: computed instead
            log.exception("reading a stored prefix failed; computed instead")
            read = False
        with self._lock:
            self.restoring.discard(request.request_id)
            self._commit(request, pending, read)
            self._lock.notify_all()

    def _commit(self, request: Request, pending: PendingRestore, read: bool) -> None:
        """Under the lock: commit all of ``request``'s stored prefix, or (``read`` false: the
        file failed a check or the request was cancelled meanwhile) none. A request the
        engine ended meanwhile (its loop failed) stays ended."""
        if request.state == "done":
            return
        try:
            self._admission.finish_restore(request, pending, read)
        except Exception:
            log.exception("committing a stored prefix failed; ending its request")
            self._end(request, "error")

    def shutdown(self) -> None:
        """Wait for a read in flight (one a failed loop left; none otherwise)."""
        self._thread.shutdown(wait=True)
