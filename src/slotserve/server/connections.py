"""What one HTTP connection may hold, and the count of those held.

`HTTPLimits` (frozen, validated) is the server's connection policy: a deadline on each
request head and on each request body, a cap on the connections open at once and on those
from one client address. `ConnectionTracker` counts, on the event loop, the connections
admitted, the ones refused by each cap and the ones closed at each deadline;
`ConnectionStats` is its frozen reading, which `/metrics` exposes. The protocol that
enforces the limits is `server.protocol`; this module imports no HTTP stack.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_HEADER_TIMEOUT_S = 5.0
# A 1 MiB body (the default --max-body-bytes) within this needs 100 KiB/s.
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
# What a refused client is told to wait before it tries again.
RETRY_AFTER_S = 1

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
    the connection is closed. ``max_connections``: connections open at once; the next gets
    503 with ``Retry-After``. ``max_connections_per_client``: the same, per client address
    (the lower of the two caps is the one a single client meets)."""

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


@dataclass
class ConnectionTracker:
    """The connections one server holds. Used on its event loop only (the protocol's
    callbacks and the /metrics route both run there), so it takes no lock."""

    limits: HTTPLimits = field(default_factory=HTTPLimits)
    open: int = 0
    by_client: Counter[str] = field(default_factory=Counter)
    refused: Counter[Cap] = field(default_factory=Counter)
    timed_out: Counter[Deadline] = field(default_factory=Counter)

    def admit(self, client: str) -> Cap | None:
        """Count a new connection from ``client`` (its address) as open, or return the cap
        it would exceed (counted as a refusal; the connection is not counted as open)."""
        cap: Cap | None = None
        if self.open >= self.limits.max_connections:
            cap = "max_connections"
        elif self.by_client[client] >= self.limits.max_connections_per_client:
            cap = "max_connections_per_client"
        if cap is not None:
            self.refused[cap] += 1
            return cap
        self.open += 1
        self.by_client[client] += 1
        return None

    def release(self, client: str) -> None:
        """An admitted connection from ``client`` closed: its place is free."""
        self.open -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]

    def timeout(self, deadline: Deadline) -> None:
        self.timed_out[deadline] += 1

    def refusal_message(self, cap: Cap, client: str) -> str:
        """What a refused client reads: the count, the limit and the fix."""
        if cap == "max_connections":
            limit = self.limits.max_connections
            return (
                f"the server has {self.open} connections open, its limit "
                f"(--max-connections {limit}); retry in {RETRY_AFTER_S} s, close idle "
                "connections, or start the server with a higher --max-connections"
            )
        limit = self.limits.max_connections_per_client
        return (
            f"this client ({client}) has {self.by_client[client]} connections open, the limit "
            f"per client address (--max-connections-per-client {limit}); close some (reuse "
            "kept-alive connections), retry in "
            f"{RETRY_AFTER_S} s, or start the server with a higher --max-connections-per-client"
        )

    def stats(self) -> ConnectionStats:
        return ConnectionStats(
            open=self.open,
            max_connections=self.limits.max_connections,
            refused={cap: self.refused[cap] for cap in CAPS},
            timed_out={deadline: self.timed_out[deadline] for deadline in DEADLINES},
        )
