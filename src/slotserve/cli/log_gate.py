"""`LogGate`: log lines never land inside an answer streamed on stdout.

A terminal shows stdout and stderr on one screen, so a log line written to stderr while the
answer streams on stdout appears in the middle of the answer (the kernels' contention
notice, which the engine thread logs as soon as it sees the cores taken, did). While the
gate holds (`holding`), every record waits; when the answer is out they are written, in
order, to the handlers that were there before. Throughout the command each distinct message
(logger, level and format string) is written once: a notice that the engine repeats each
time it sees the same trouble (the kernels' contention notice after each failed probe)
shows once, before or after the answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class LogGate(logging.Handler):
    """Stands in for the root logger's handlers while entered: passes each distinct
    message on once, and holds records while `holding` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._root = logging.getLogger()
        self._handlers: list[logging.Handler] = []
        self._seen: set[tuple[str, int, str]] = set()
        self._held: list[logging.LogRecord] = []
        self._holding = False
        self._gate_lock = threading.Lock()  # the engine thread logs while the caller streams

    def __enter__(self) -> LogGate:
        self._handlers = list(self._root.handlers)
        self._root.handlers = [self]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._root.handlers = self._handlers
        self._release()

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.name, record.levelno, str(record.msg))
        with self._gate_lock:
            if key in self._seen:
                return
            self._seen.add(key)
            if self._holding:
                self._held.append(record)
                return
        self._pass(record)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold every record while the body streams; write them when it ends."""
        with self._gate_lock:
            self._holding = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._gate_lock:
            held, self._held, self._holding = self._held, [], False
        for record in held:
            self._pass(record)

    def _pass(self, record: logging.LogRecord) -> None:
        for handler in self._handlers:  # as `Logger.callHandlers` does
            if record.levelno >= handler.level:
                handler.handle(record)


class DropStatsLine(logging.Filter):
    """Drops the runner's ExecuTorch stats line (``PyTorchObserver {...}``): `generate`
    shows it only when asked (``--stats``, ``--json``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorchObserver")
