"""`ResponseStore`: the recent responses of the Responses API, so a request can continue one
(``previous_response_id``) or fetch it again; bounded, least recently used dropped first.

A stored response keeps its conversation as chat messages (every turn's input and output,
without the instructions, which do not carry over) and its response object. Nothing else:
the KV of the conversation lives in the engine's prefix cache, which a continuation finds
by its tokens. Any thread may call it; ``store: false`` requests never reach it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_STORED_RESPONSES = 256


@dataclass(frozen=True)
class StoredResponse:
    conversation: list[dict[str, Any]]  # chat messages, input and output, oldest first
    response: dict[str, Any]  # the response object as it was answered


class ResponseStore:
    def __init__(self, size: int = DEFAULT_STORED_RESPONSES) -> None:
        if size < 0:
            raise ValueError(f"size={size} must be >= 0")
        self.size = size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._responses[response_id] = stored
            self._responses.move_to_end(response_id)
            while len(self._responses) > self.size:
                self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def __len__(self) -> int:
        return len(self._responses)
