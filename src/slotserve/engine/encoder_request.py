"""An embedding request of the encoder engine (`EmbeddingRequest`), its result
(`EmbeddingResult`) and the caller's handle (`EmbeddingHandle`).

A request is a list of texts, tokenised at submit and embedded in steps of at most the
engine's ``max_batch_texts`` texts (longest first, as sentence-transformers orders them, so
a step pads little); it holds its ``n_texts`` text slots from admission to release. The
engine thread owns every field but ``cancelled`` (set by any thread) and reads the handle's
drop only as a recorded id (`slotserve.engine.handle` states why a finalizer takes no lock).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from slotserve.engine.events import CancelAck, Priority
from slotserve.engine.sink import EventSink
from slotserve.errors import AdmissionRefused

EmbeddingState = Literal["queued", "running", "done"]
EmbeddingEnd = Literal["stop", "cancelled", "error"]


@dataclass
class EmbeddingTimings:
    """Timestamps of one request on the engine's clock."""

    submitted: float
    admitted: float | None = None
    first_step: float | None = None
    cancel_requested: float | None = None
    released: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def cancel_to_release(self) -> float | None:
        if self.cancel_requested is None or self.released is None:
            return None
        return max(self.released - self.cancel_requested, 0.0)


@dataclass(frozen=True)
class EmbeddingResult:
    """The one terminal event of an admitted request: ``embeddings[n_texts, dim]`` in the
    order the texts were given (rows of texts not embedded are zero when ``reason`` is not
    ``"stop"``), ``prompt_tokens`` over all texts (after truncation), its class and timings."""

    reason: EmbeddingEnd
    embeddings: torch.Tensor
    prompt_tokens: int
    priority: Priority
    timings: EmbeddingTimings
    error: str | None = None


@dataclass(eq=False)
class EmbeddingRequest:
    """One submit call: ``texts`` (token ids, in the caller's order) and the order it
    embeds them in (``pending``: indices, longest text first)."""

    request_id: int
    texts: list[list[int]]
    priority: Priority
    timings: EmbeddingTimings
    dim: int
    state: EmbeddingState = "queued"
    deadline: float | None = None
    sink: EventSink = field(default_factory=EventSink)
    cancelled: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    pending: list[int] = field(init=False)
    embeddings: torch.Tensor = field(init=False)  # [n_texts, dim], rows filled as embedded
    in_step: list[int] = field(default_factory=list)  # indices the current step embeds
    embedded: int = 0

    def __post_init__(self) -> None:
        self.pending = sorted(range(len(self.texts)), key=lambda i: -len(self.texts[i]))
        self.embeddings = torch.zeros(len(self.texts), self.dim)

    @property
    def n_texts(self) -> int:
        return len(self.texts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(text) for text in self.texts)

    @property
    def ready(self) -> bool:
        """Running with texts left to step and not cancelled."""
        return self.state == "running" and bool(self.pending) and not self.cancelled.is_set()

    def take(self, n: int) -> list[int]:
        """Move the next ``n`` pending texts into the step; their indices."""
        chosen, self.pending = self.pending[:n], self.pending[n:]
        self.in_step = chosen
        return chosen

    def commit(self, rows: torch.Tensor) -> None:
        """The step's embeddings of the texts `take` gave it."""
        self.embeddings[self.in_step] = rows
        self.embedded += len(self.in_step)
        self.in_step = []

    def abandon_step(self) -> None:
        """The step failed or the request left: its texts are not embedded."""
        self.pending = self.in_step + self.pending
        self.in_step = []

    def cancel(self, now: float) -> None:
        if not self.cancelled.is_set():
            self.timings.cancel_requested = now
            self.cancelled.set()

    def result(self, reason: EmbeddingEnd, error: str | None = None) -> EmbeddingResult:
        return EmbeddingResult(
            reason, self.embeddings, self.prompt_tokens, self.priority, self.timings, error
        )


class EmbeddingHandle:
    """The caller's side of an embedding request: `result` (blocking) or `aresult`
    (asyncio) give its `EmbeddingResult`, or raise the `AdmissionRefused` a queued request
    met; `cancel` returns at once (``wait=True``: once its text slots are released, with the
    measured latency). A handle dropped without cancel is reclaimed the same way."""

    def __init__(
        self,
        request_id: int,
        sink: EventSink,
        cancel: Callable[[int, bool, float | None], CancelAck | None],
        drop: Callable[[int], None],
    ) -> None:
        self.request_id = request_id
        self._sink = sink
        self._cancel = cancel
        self._outcome: EmbeddingResult | AdmissionRefused | None = None
        self._finalizer = weakref.finalize(self, drop, request_id)

    def _settle(self, item: object) -> EmbeddingResult:
        assert isinstance(item, EmbeddingResult | AdmissionRefused), item
        self._outcome = item
        self._finalizer.detach()
        if isinstance(item, AdmissionRefused):
            raise item
        return item

    def result(self, timeout: float | None = None) -> EmbeddingResult:
        """Block until the request ends (`TimeoutError` after ``timeout`` seconds)."""
        if self._outcome is None:
            return self._settle(self._sink.get(timeout))
        return self._settle(self._outcome)

    async def aresult(self) -> EmbeddingResult:
        """`result` for an asyncio caller."""
        if self._outcome is None:
            return self._settle(await self._sink.aget())
        return self._settle(self._outcome)

    @property
    def done(self) -> bool:
        """Whether the result (or refusal) has been read."""
        return self._outcome is not None

    def cancel(self, wait: bool = False, timeout: float | None = 10.0) -> CancelAck | None:
        """Stop the request at the next batch boundary. Idempotent."""
        return self._cancel(self.request_id, wait, timeout)
