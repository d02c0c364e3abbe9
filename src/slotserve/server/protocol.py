"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol plus a deadline on request heads.

uvicorn times out only idle keep-alive connections: a client that connects and then sends
nothing, or part of a request line, or a header a byte at a time, holds its connection (and
a file descriptor) for as long as it likes. Here every request head must arrive whole within
``header_timeout_s`` of the connection opening (for the first request) or of its first byte
(for the next ones on a kept-alive connection); otherwise the connection is closed. The
deadline is not extended by the bytes that trickle in, so a slow sender gains nothing.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("slotserve")

DEFAULT_HEADER_TIMEOUT_S = 5.0


class HeaderDeadlineProtocol(H11Protocol):
    """`H11Protocol` that closes a connection whose request head is not complete in time."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self._awaiting_request_head():
            self._arm_header_deadline()  # the first bytes of a next request on this connection
        super().data_received(data)
        if not self._awaiting_request_head():
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _awaiting_request_head(self) -> bool:
        # h11 leaves IDLE for the client's side once a whole request head was parsed.
        return bool(self.conn.their_state is h11.IDLE)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _head_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or not self._awaiting_request_head():
            return
        log.debug(
            "closing a connection from %s: no complete request head within %ss",
            self.client,
            self.header_timeout_s,
        )
        self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to give uvicorn (``http=``) for a server with this deadline."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s={header_timeout_s}: give a number of seconds > 0")
    return type(
        "HeaderDeadlineProtocol",
        (HeaderDeadlineProtocol,),
        {"header_timeout_s": float(header_timeout_s)},
    )
