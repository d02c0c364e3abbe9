"""`Request`: everything the engine knows of one request, owned by the engine thread.

It holds the event sink shared with the caller's `RequestHandle`, never the handle itself,
so a handle its owner drops can be garbage-collected (and then reclaimed). Timestamps are
passed in by the engine, whose clock is the only one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from slotserve.engine.events import Finished, FinishReason, Pooling, Priority, TokenEvent, Usage
from slotserve.engine.sink import EventSink
from slotserve.engine.timings import RequestTimings
from slotserve.sampling import RequestSampler, SamplingParams, StopMatcher
from slotserve.tokenizer import StreamDecoder

RequestState = Literal["queued", "running", "done"]


@dataclass
class Request:
    """A request's state: ``queued`` → ``running`` (prefill, then decode) → ``done``."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    priority: Priority
    sampler: RequestSampler
    decoder: StreamDecoder
    stops: StopMatcher
    eos_ids: frozenset[int]
    sink: EventSink
    timings: RequestTimings
    deadline: float | None = None
    state: RequestState = "queued"
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    pending_token: int | None = None  # sampled, to be fed by the next decode step
    eos_token: int | None = None
    last_step: int = -1  # the engine step that last advanced this request (fairness)
    published: bool = False  # its prompt was offered to the prefix cache
    publish_completion: bool = False  # at the end, keep prompt + completion in the cache
    cancelled: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    # An embedding request (prefill only): how its final hidden states are pooled, and
    # what has been pooled so far (`pool_rows`).
    pooling: Pooling | None = None
    pooled: torch.Tensor | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def reservation(self) -> int:
        """Positions reserved at admission: the worst case of this request."""
        return len(self.prompt) + self.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt)

    def emit_token(
        self,
        token: int,
        now: float,
        logprob: float | None = None,
        top_logprobs: tuple[tuple[int, float], ...] = (),
    ) -> bool:
        """Record a sampled token and stream its text; True when the request is done."""
        self.timings.token_times.append(now)
        self.generated.append(token)
        piece, stopped = self.stops.push(self.decoder.push(token))
        self.text.append(piece)
        index = len(self.generated) - 1
        self.sink.put(TokenEvent(token, piece, index, now, logprob, top_logprobs))
        return stopped or len(self.generated) >= self.max_new_tokens

    def pool_rows(self, hidden: torch.Tensor) -> None:
        """Pool the final hidden states ``[n, dim]`` of the prompt chunk just computed: their
        sum (mean pooling, float64), the prompt's first row (CLS pooling: the first chunk's)
        or the last row (last-token pooling)."""
        if self.pooling == "last":
            self.pooled = hidden[-1].double()
        elif self.pooling == "cls":
            if self.pooled is None:
                self.pooled = hidden[0].double()
        else:
            total = hidden.double().sum(dim=0)
            self.pooled = total if self.pooled is None else self.pooled + total

    def embedding(self) -> tuple[float, ...] | None:
        """The pooled vector, L2-normalised (None: not an embedding request, or it did not
        complete its prompt)."""
        if self.pooled is None or self.in_prefill:
            return None
        vector = self.pooled / len(self.prompt) if self.pooling == "mean" else self.pooled
        norm = float(vector.norm())
        return tuple((vector / norm if norm > 0 else vector).float().tolist())

    def cancel(self, now: float) -> None:
        """Ask for this request's end at the next step boundary (the first ask's time is the
        start of its cancel→release latency)."""
        if self.timings.cancel_requested is None:
            self.timings.cancel_requested = now
        self.cancelled.set()

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> Finished:
        """Flush held-back text, send the terminal event and return it."""
        if not self.stops.stopped and reason != "error":
            tail = self.stops.push(self.decoder.flush())[0] + self.stops.flush()
            if tail:
                self.text.append(tail)
                self.sink.put(TokenEvent(-1, tail, len(self.generated), now))
        self.timings.finished = now
        self.state = "done"
        finished = Finished(
            reason=reason,
            usage=Usage(len(self.prompt), len(self.generated), self.timings.prompt_tokens_restored),
            timings=self.timings,
            text="".join(self.text),
            tokens=tuple(self.generated),
            error=error,
            eos_token=self.eos_token,
            priority=self.priority,
            embedding=self.embedding() if reason != "error" else None,
        )
        self.sink.put(finished)
        return finished
