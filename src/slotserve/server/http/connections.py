"""What one HTTP connection may hold, and the places those connections hold.

`HTTPLimits` (frozen, validated) is the server's connection policy: a deadline on each
request head and on each request body, a cap on the connections open at once and on those
from one remote client address. `ConnectionTracker` holds, on the event loop, the place of
every admitted connection, and counts the ones refused by each cap, the idle ones closed to
make room and the ones closed at each deadline; `ConnectionStats` is its frozen reading,
which `/metrics` exposes. The protocol that enforces the limits is `server.protocol`; this
module imports no HTTP stack.

**Fairness.** On a device every client is local: every app connects from 127.0.0.1, so an
address says nothing about who is asking, and an app that holds its kept-alive connections
would lock every other app out until those connections timed out. So the caps are on what a
connection *does*, not on where it comes from:

- a connection is **idle** between requests: admitted and no whole request head received
  yet, or its last response sent and no whole next head received (a head still trickling
  in is not a request yet: the app has not seen it). Every other connection is inside a
  request (its body arriving, the app answering);
- at a cap, the connection idle the longest is closed to admit the new one, if it has been
  idle for at least ``IDLE_GRACE_S`` (what a client's next bytes, or a fresh connection's
  first ones, may take to arrive; a client refused for want of one retries after
  ``RETRY_AFTER_S``, which is as long). Closing an idle kept-alive connection is what its
  keep-alive timeout would do anyway; clients reconnect. A new connection is refused (503,
  ``Retry-After``) only when every place is inside a request or was idle for under the
  grace: requests in progress always count toward the cap, and are never closed for room;
- ``max_connections_per_client`` applies to remote addresses only. A loopback address
  (127.0.0.0/8, ::1) is every local app at once, so it gets the whole of
  ``max_connections``, and the fairness above is what keeps one local app from holding it.
  A remote client at its own cap makes room by closing its own longest-idle connection.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

DEFAULT_HEADER_TIMEOUT_S = 5.0
# A body of the default --max-body-bytes arrives within this at a tenth of its size a
# second: the floor a client's upload rate must clear.
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
# What a refused client is told to wait before it tries again.
RETRY_AFTER_S = 1
# How long a connection must have been idle before it may be closed to admit another: the
# time a client's next request (or a fresh connection's first bytes) may take to arrive.
IDLE_GRACE_S = 1.0

Cap = Literal["max_connections", "max_connections_per_client"]
Deadline = Literal["head", "body"]
CAPS: tuple[Cap, ...] = ("max_connections", "max_connections_per_client")
DEADLINES: tuple[Deadline, ...] = ("head", "body")


@dataclass(frozen=True)
class HTTPLimits:
    """How long a request may take to arrive, and how many connections may be open.

    ``header_timeout_s``: a request head must arrive whole within this of the connection
    opening (or of its first byte, for a next request on a kept-alive connection).
    ``body_timeout_s``: its body must arrive whole within this of the head; else 408 and
    the connection is closed. ``max_connections``: connections open at once; at it, the
    connection idle the longest (for at least ``IDLE_GRACE_S``) is closed to admit the next,
    and where none is, the next gets 503 with ``Retry-After``. ``max_connections_per_client``:
    the same, per remote client address; loopback clients (every local app) share
    ``max_connections`` alone (see the module's docstring)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT

    def __post_init__(self) -> None:
        _check_seconds(
            "header_timeout_s", "--header-timeout", self.header_timeout_s, DEFAULT_HEADER_TIMEOUT_S
        )
        _check_seconds(
            "body_timeout_s", "--body-timeout", self.body_timeout_s, DEFAULT_BODY_TIMEOUT_S
        )
        _check_count(
            "max_connections", "--max-connections", self.max_connections, DEFAULT_MAX_CONNECTIONS
        )
        _check_count(
            "max_connections_per_client",
            "--max-connections-per-client",
            self.max_connections_per_client,
            DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        )


def _check_seconds(name: str, flag: str, value: object, default: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r} ({flag}): give a number of seconds")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{name}={value!r} ({flag}): give a finite number of seconds > 0 (default {default:g})"
        )


def _check_count(name: str, flag: str, value: object, default: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name}={value!r} ({flag}): give a whole number of connections >= 1 "
            f"(default {default})"
        )


@dataclass(frozen=True)
class ConnectionStats:
    """A reading of `ConnectionTracker`: open now, and the totals since the start."""

    open: int
    max_connections: int
    refused: dict[Cap, int]
    timed_out: dict[Deadline, int]
    evicted: int  # idle connections closed to admit another


class Place(Protocol):
    """An admitted connection, as the tracker sees it."""

    def evict(self) -> None:
        """Close this idle connection now, to make room; its place is already released."""


def is_loopback(client: str) -> bool:
    """Whether ``client`` (an address, "" for a Unix socket) is on this machine."""
    if not client:
        return True
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass
class ConnectionTracker:
    """The connections one server holds: each admitted connection's place (its client's
    address) and which of them are idle, longest-idle first. Used on its event loop only
    (the protocol's callbacks and the /metrics route both run there), so it takes no lock.

    Invariants (`check_integrity`): ``open`` is the number of places, ``by_client`` counts
    them by address, and every idle place is a place."""

    limits: HTTPLimits = field(default_factory=HTTPLimits)
    clock: Callable[[], float] = time.monotonic
    open: int = 0
    by_client: Counter[str] = field(default_factory=Counter)
    refused: Counter[Cap] = field(default_factory=Counter)
    timed_out: Counter[Deadline] = field(default_factory=Counter)
    evicted: int = 0
    _places: dict[Place, str] = field(default_factory=dict)  # place -> its client's address
    _idle: dict[Place, float] = field(default_factory=dict)  # since when; oldest first

    def admit(self, client: str, place: Place) -> Cap | None:
        """Give ``place``, a new connection from ``client`` (its address), a place, idle;
        at a cap, close the longest-idle connection (the client's own, at the per-client
        cap) to make room. Where none has been idle for ``IDLE_GRACE_S``, return the cap
        it would exceed (counted as a refusal; the connection holds no place)."""
        cap: Cap | None = None
        remote_full = (
            not is_loopback(client)
            and self.by_client[client] >= self.limits.max_connections_per_client
        )
        if remote_full and not self._evict_idle(client):
            cap = "max_connections_per_client"
        elif self.open >= self.limits.max_connections and not self._evict_idle(None):
            cap = "max_connections"
        if cap is not None:
            self.refused[cap] += 1
            return cap
        self._places[place] = client
        self.open += 1
        self.by_client[client] += 1
        self._idle[place] = self.clock()
        return None

    def idle(self, place: Place) -> None:
        """``place`` is between requests from now (it may be closed to make room)."""
        if place in self._places:
            self._idle.pop(place, None)
            self._idle[place] = self.clock()

    def busy(self, place: Place) -> None:
        """``place`` is inside a request from now (it holds its place until it is idle)."""
        self._idle.pop(place, None)

    def release(self, place: Place) -> None:
        """An admitted connection closed (or stopped counting): its place is free. Releasing
        a place twice, or one never admitted, does nothing."""
        client = self._places.pop(place, None)
        if client is None:
            return
        self._idle.pop(place, None)
        self.open -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]

    def _evict_idle(self, client: str | None) -> bool:
        """Release and close the longest-idle place (of ``client``, or of anyone), if it has
        been idle for ``IDLE_GRACE_S``; whether one was."""
        settled = self.clock() - IDLE_GRACE_S
        for place, since in self._idle.items():  # oldest first
            if since > settled:
                return False
            if client is None or self._places[place] == client:
                self.release(place)
                self.evicted += 1
                place.evict()
                return True
        return False

    def timeout(self, deadline: Deadline) -> None:
        self.timed_out[deadline] += 1

    def refusal_message(self, cap: Cap, client: str) -> str:
        """What a refused client reads: the count, the limit and the fix."""
        busy = f"every one inside a request or idle for under {IDLE_GRACE_S:g} s"
        if cap == "max_connections":
            limit = self.limits.max_connections
            return (
                f"the server has {self.open} connections open, its limit "
                f"(--max-connections {limit}), {busy}; retry in {RETRY_AFTER_S} s, or start "
                "the server with a higher --max-connections"
            )
        limit = self.limits.max_connections_per_client
        return (
            f"this client ({client}) has {self.by_client[client]} connections open, the limit "
            f"per remote client address (--max-connections-per-client {limit}), {busy}; "
            f"reuse kept-alive connections, retry in {RETRY_AFTER_S} s, or start the server "
            "with a higher --max-connections-per-client"
        )

    def stats(self) -> ConnectionStats:
        return ConnectionStats(
            open=self.open,
            max_connections=self.limits.max_connections,
            refused={cap: self.refused[cap] for cap in CAPS},
            timed_out={deadline: self.timed_out[deadline] for deadline in DEADLINES},
            evicted=self.evicted,
        )

    def check_integrity(self) -> None:
        assert self.open == len(self._places), (self.open, len(self._places))
        assert self.by_client == Counter(self._places.values()), self.by_client
        assert set(self._idle) <= set(self._places), "an idle connection without a place"
        since = list(self._idle.values())
        assert since == sorted(since), "idle connections out of order"
