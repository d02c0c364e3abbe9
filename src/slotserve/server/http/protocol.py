"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol plus the server's `HTTPLimits`.

uvicorn times out only idle keep-alive connections: a client that connects and then sends
nothing, or part of a request, or a body a byte at a time, holds its connection (a file
descriptor and its buffers) for as long as it likes, and uvicorn accepts as many as the
process has descriptors. Here, per connection:

- **the head**: every request head must arrive whole within ``header_timeout_s`` of the
  connection opening (for the first request) or of its first byte (for the next ones on a
  kept-alive connection); otherwise the connection is closed;
- **the body**: its body must arrive whole within ``body_timeout_s`` of the head; otherwise
  the request is answered 408 (if nothing was answered yet) and the connection closed. The
  app reading the body sees a disconnect;
- **the caps**: a connection beyond ``max_connections`` open at once, or beyond
  ``max_connections_per_client`` from its remote client's address, first makes room by
  closing the connection idle the longest (see `connections` for the fairness rule); where
  none has been idle long enough, it is answered 503 with ``Retry-After`` as soon as its
  request head arrives (the head deadline still holds) and closed; it never reaches the app
  and holds no place. A closed connection frees its place.

A connection is idle (`ConnectionTracker.idle`) from its opening, and again whenever its
response is complete and h11 awaits the next request head; it is inside a request
(`ConnectionTracker.busy`) from the moment h11 has parsed a whole request head until that
response is complete. Bytes of a head still arriving do not make it busy: only a request
the app has been given holds a place against the others. Closing an idle connection to make
room is uvicorn's own keep-alive timeout, early: the transport closes and the client, which
has no response outstanding, reconnects.

No deadline is extended by the bytes that trickle in, so a slow sender gains nothing. What
is refused and what timed out is counted in the `ConnectionTracker` (``/metrics``). The API
key is checked from the head, before any body byte is read: `security.KeyedRoute`.

A connection closed while its request body is still arriving (a 401 from the head, a 413,
a 408, a 503) closes gracefully: the response is sent with ``Connection: close`` and a
FIN, what the client still sends is read and dropped for at most ``LINGER_S``, then the
socket closes. Closing at once would make the kernel answer the client's next bytes with a
reset, which can destroy the response before the client reads it. A lingering connection
already gave up its place under the caps.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from slotserve.server.http.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    RETRY_AFTER_S,
    Cap,
    ConnectionTracker,
    HTTPLimits,
)
from slotserve.server.http.errors import error_body

log = logging.getLogger("slotserve")

# The longest a connection answered before its body arrived stays open to drop that body.
LINGER_S = 1.0

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "LimitedProtocol", "protocol_for"]


class LimitedProtocol(H11Protocol):
    """`H11Protocol` under `HTTPLimits`: head and body deadlines, connection caps."""

    tracker: ConnectionTracker = ConnectionTracker()  # each server has its own: `protocol_for`
    _header_deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None
    _refused: Cap | None = None
    _refusal: str = ""
    _lingering: bool = False
    _socket: asyncio.Transport | None = None  # the real transport (uvicorn gets a wrapper)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport
        super().connection_made(_GracefulTransport(transport, self))
        address = self.client[0] if self.client else ""
        refused = self.tracker.admit(address, self)  # admitted idle: no request yet
        if refused is not None:  # the message now, with the counts the client was refused at
            self._refused, self._refusal = refused, self.tracker.refusal_message(refused, address)
            log.debug("refusing a connection from %s: %s", address, refused)
        self._arm_header_deadline()

    @property
    def limits(self) -> HTTPLimits:
        return self.tracker.limits

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a body nobody will read
        if self._refused is not None:
            self._refuse_at_head(data)
            return
        if self._header_deadline is None and self._awaiting_request_head():
            self._arm_header_deadline()  # the first bytes of a next request on this connection
        super().data_received(data)

    def handle_events(self) -> None:
        # Runs on new bytes and when a response completes (a pipelined request may start).
        super().handle_events()
        if not self._awaiting_request_head():
            self._disarm_header_deadline()
            self.tracker.busy(self)  # a whole head arrived: inside a request
        if self.conn.their_state is h11.SEND_BODY:
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(
                    self.limits.body_timeout_s, self._body_too_slow
                )
        else:
            self._disarm_body_deadline()

    def eof_received(self) -> None:
        if self._lingering and self._socket is not None:
            self._socket.close()  # the client sent all it had: nothing left to drop

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (handle_events)
        if not self.transport.is_closing() and self._awaiting_request_head():
            self.tracker.idle(self)  # kept alive, between requests

    def evict(self) -> None:
        """Close this idle connection to admit another (`ConnectionTracker.admit` released
        its place): what uvicorn's keep-alive timeout does, early."""
        log.debug("closing an idle connection from %s to admit another", self.client)
        self.transport.close()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._free_place()  # the socket is the WebSocket protocol's now: its close is not ours
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        self._free_place()
        super().connection_lost(exc)

    def _free_place(self) -> None:
        self.tracker.release(self)  # once: a connection without a place has none to free

    def close_gracefully(self) -> None:
        """Close the connection; if its request body is still arriving, linger first (see
        the module's docstring). What uvicorn's ``transport.close()`` calls."""
        assert self._socket is not None
        if self._lingering or self._socket.is_closing():
            return
        if self.conn.their_state is not h11.SEND_BODY or not self._socket.can_write_eof():
            self._socket.close()
            return
        self._lingering = True
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        self._free_place()
        self._socket.write_eof()  # after what is buffered: the response, then a FIN
        self.loop.call_later(LINGER_S, self._socket.close)

    # -- the head ------------------------------------------------------------------------

    def _awaiting_request_head(self) -> bool:
        # h11 leaves IDLE for the client's side once a whole request head was parsed.
        return bool(self.conn.their_state is h11.IDLE)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(
            self.limits.header_timeout_s, self._head_too_slow
        )

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _head_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or not self._awaiting_request_head():
            return
        self.tracker.timeout("head")
        log.debug(
            "closing a connection from %s: no complete request head within %ss",
            self.client,
            self.limits.header_timeout_s,
        )
        self.transport.close()

    # -- the body ------------------------------------------------------------------------

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        self.tracker.timeout("body")
        timeout = self.limits.body_timeout_s
        log.debug(
            "closing a connection from %s: body not complete within %ss", self.client, timeout
        )
        cycle = self.cycle
        if cycle is None or cycle.response_started or cycle.disconnected:
            self.transport.close()  # already answered (e.g. 401 from the head): only close
            return
        # The app waiting on the body reads a disconnect, and anything it sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        declared = dict(self.headers or []).get(b"content-length")
        size = f" of {declared.decode('latin-1')} bytes" if declared is not None else ""
        message = (
            f"the request body{size} did not arrive within {timeout:g} s of its head, the "
            "server's limit (--body-timeout); send the body at once, or start the server "
            "with a higher --body-timeout"
        )
        self._answer_and_close(408, message, "invalid_request_error", "request_timeout")

    # -- the caps ------------------------------------------------------------------------

    def _refuse_at_head(self, data: bytes) -> None:
        """A connection beyond a cap: read its head, answer 503, close."""
        self.conn.receive_data(data)
        try:
            event = self.conn.next_event()
        except h11.RemoteProtocolError:
            self.transport.close()
            return
        if event is h11.NEED_DATA:
            return
        self._disarm_header_deadline()
        retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        self._answer_and_close(503, self._refusal, "server_error", "too_many_connections", retry)

    # -- answering outside the app -------------------------------------------------------

    def _answer_and_close(
        self,
        status: int,
        message: str,
        kind: str,
        code: str,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Write an OpenAI error response with ``Connection: close``, then close."""
        body = json.dumps(error_body(message, kind, code=code)).encode()
        head = [
            *self.server_state.default_headers,  # date, server: as uvicorn's own responses
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *(headers or []),
        ]
        try:
            for event in (
                h11.Response(status_code=status, headers=head, reason=STATUS_PHRASES[status]),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                output = self.conn.send(event)
                if output:
                    self.transport.write(output)
        except h11.LocalProtocolError:  # a response already begun: closing is all there is
            pass
        self.transport.close()


class _GracefulTransport(asyncio.Transport):
    """The transport uvicorn's protocol writes to: the socket's own, except that closing it
    closes gracefully (`LimitedProtocol.close_gracefully`) and a lingering one reads as
    closing."""

    def __init__(self, socket: asyncio.Transport, protocol: LimitedProtocol) -> None:
        super().__init__()
        self._socket, self._protocol = socket, protocol

    def close(self) -> None:
        self._protocol.close_gracefully()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._socket.is_closing()

    def abort(self) -> None:
        self._socket.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._socket.get_extra_info(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._socket.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self._socket.writelines(list_of_data)

    def write_eof(self) -> None:
        self._socket.write_eof()

    def can_write_eof(self) -> bool:
        return self._socket.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._socket.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._socket.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._socket.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._socket.pause_reading()

    def resume_reading(self) -> None:
        self._socket.resume_reading()

    def is_reading(self) -> bool:
        return self._socket.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._socket.set_protocol(protocol)  # a WebSocket upgrade: the socket is theirs

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._socket.get_protocol()


def protocol_for(tracker: ConnectionTracker) -> type[LimitedProtocol]:
    """The protocol class to give uvicorn (``http=``) for a server under ``tracker.limits``
    that counts its connections in ``tracker`` (one per server)."""
    return type("LimitedProtocol", (LimitedProtocol,), {"tracker": tracker})
