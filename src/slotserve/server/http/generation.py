"""Running n engine requests for one HTTP request: submit, collect, stream, cancel.

A client that goes away (a closed stream, or a disconnect while a non-streamed request
runs) cancels its requests; the engine frees their slots at the next batch boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from fastapi import Request

from slotserve.engine import Engine, Finished, RequestHandle, TokenEvent
from slotserve.errors import AdmissionRefused
from slotserve.sampling import SamplingParams
from slotserve.server.http.errors import APIError, refusal_error

DISCONNECT_POLL_S = 0.05


@dataclass
class Outcome:
    """What one choice produced."""

    events: list[TokenEvent] = field(default_factory=list)
    final: Finished | None = None


def submit_all(
    engine: Engine,
    prompt: str | list[int],
    params: list[SamplingParams],
    priority: str,
    prompt_param: str | None = None,
    *,
    keep_conversation: bool = False,
) -> list[RequestHandle]:
    """Submit one request per choice; all are admitted, or none stays admitted.
    ``prompt_param`` names the request field a too-long prompt came from. With
    ``keep_conversation`` (a one-choice chat turn), the prompt and the reply stay in the
    engine's prefix cache, if it has one, for the conversation's next turn."""
    handles: list[RequestHandle] = []
    publish = keep_conversation and len(params) == 1
    try:
        for choice_params in params:
            handles.append(
                engine.submit(
                    prompt, choice_params, priority, queue=True, publish_completion=publish
                )
            )
    except AdmissionRefused as refusal:
        for handle in handles:
            handle.cancel()
        raise refusal_error(refusal, prompt_param) from None
    except ValueError as exc:
        for handle in handles:
            handle.cancel()
        raise APIError(400, str(exc), "invalid_request_error", code="invalid_value") from None
    return handles


async def merged(
    handles: list[RequestHandle],
) -> AsyncGenerator[tuple[int, TokenEvent | Finished], None]:
    """Events of all handles as they come, tagged with the choice index."""
    queue: asyncio.Queue[tuple[int, TokenEvent | Finished | BaseException]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for event in handle:
                await queue.put((index, event))
        except AdmissionRefused as refusal:
            await queue.put((index, refusal))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise refusal_error(item) if isinstance(item, AdmissionRefused) else item
            if isinstance(item, Finished):
                remaining -= 1
            yield index, item
    finally:
        for handle in handles:
            handle.cancel()
        for task in tasks:
            task.cancel()


async def collect(handles: list[RequestHandle], request: Request) -> list[Outcome]:
    """Wait for every choice; cancel them all if the client disconnects meanwhile."""
    outcomes = [Outcome() for _ in handles]

    async def gather() -> None:
        async for index, event in merged(handles):
            if isinstance(event, TokenEvent):
                outcomes[index].events.append(event)
            else:
                outcomes[index].final = event

    task = asyncio.create_task(gather())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "client_closed")
        task.result()
    finally:
        for handle in handles:
            handle.cancel()
    return outcomes
