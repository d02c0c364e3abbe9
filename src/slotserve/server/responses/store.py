"""`ResponseStore`: the recent responses of the Responses API, so a request can continue one
(``previous_response_id``) or fetch it again; bounded by count and by bytes, least recently
used dropped first.

A stored response keeps its conversation as chat messages (every turn's input and output,
without the instructions, which do not carry over) and its response object. Nothing else:
the KV of the conversation lives in the engine's prefix cache, which a continuation finds
by its tokens. Each is charged the bytes its Python objects hold, measured as it is put
(`held_bytes`: every dict, list and string; a string two stored responses share is charged
to both), and the store never holds more than ``budget_bytes``: the server counts that
budget in the memory plan at its start, where the budget is the process's
(`http.serve.CancellingServer`). A response larger than the whole budget is not kept. Any thread
may call it; ``store: false`` requests never reach it.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_STORED_RESPONSES = 256
DEFAULT_STORED_BYTES = 16 << 20


def held_bytes(value: Any) -> int:
    """The bytes the Python objects of ``value`` (a decoded JSON value) hold: each container
    and each leaf by `sys.getsizeof`, an object met twice counted once."""
    seen: set[int] = set()
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return total


@dataclass(frozen=True)
class StoredResponse:
    conversation: list[dict[str, Any]]  # chat messages, input and output, oldest first
    response: dict[str, Any]  # the response object as it was answered

    def held_bytes(self) -> int:
        return held_bytes([self.conversation, self.response])


class ResponseStore:
    """At most ``size`` responses and ``budget_bytes`` of them (`StoredResponse.held_bytes`,
    measured once, as each is put)."""

    def __init__(
        self, size: int = DEFAULT_STORED_RESPONSES, budget_bytes: int = DEFAULT_STORED_BYTES
    ) -> None:
        if size < 0:
            raise ValueError(f"size={size} must be >= 0")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
        self.size, self.budget_bytes = size, budget_bytes
        self.held_bytes = 0  # the stored responses' bytes, summed
        self._responses: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep ``stored``, dropping the least recently used past the bounds; False (and
        nothing dropped) when it is not kept: it alone is larger than the whole budget, or
        the store keeps none (``size`` 0)."""
        nbytes = stored.held_bytes()  # outside the lock: it walks the whole response
        if nbytes > self.budget_bytes or self.size == 0:
            return False
        with self._lock:
            _, old = self._responses.pop(response_id, (stored, 0))
            self._responses[response_id] = (stored, nbytes)
            self.held_bytes += nbytes - old
            while len(self._responses) > self.size or self.held_bytes > self.budget_bytes:
                _, (_, dropped) = self._responses.popitem(last=False)
                self.held_bytes -= dropped
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._responses.get(response_id)
            if entry is None:
                return None
            self._responses.move_to_end(response_id)
            return entry[0]

    def view(self) -> dict[str, int]:
        """What the store holds against its bounds, JSON-ready (the dashboard's feed)."""
        with self._lock:
            stored, held = len(self._responses), self.held_bytes
        return {
            "stored": stored,
            "size": self.size,
            "held_bytes": held,
            "budget_bytes": self.budget_bytes,
        }

    def describe(self) -> str:
        """The bounds, as a refusal of an id no longer (or never) stored says them."""
        return (
            f"this server keeps the {self.size} most recently used responses within "
            f"{self.budget_bytes / 2**20:.1f} MiB"
        )

    def check_integrity(self) -> None:
        with self._lock:
            held = sum(nbytes for _, nbytes in self._responses.values())
            assert held == self.held_bytes, (held, self.held_bytes)
            assert self.held_bytes <= self.budget_bytes, (self.held_bytes, self.budget_bytes)
            assert len(self._responses) <= self.size, (len(self._responses), self.size)

    def __len__(self) -> int:
        return len(self._responses)
