"""OpenAI's chat completions: every ``/v1/chat/completions`` request, submitted by
`chat.run.start_chat` (the one chat path) and answered here. The reply is read for its
structure (`chat.reply`) where it has one: its tool calls (decoded under its `ToolPlan`'s
grammar) and its thinking section (`reasoning`), answered as OpenAI does:
``message.tool_calls`` with ``finish_reason: "tool_calls"`` and
``message.reasoning_content``, or streamed as ``delta.tool_calls`` chunks (each call's
index, id, type and name first, then its arguments as they are written) and
``delta.reasoning_content`` chunks. A reply without either is its text as it came. A
constrained document the grammar could not finish is an error, never a ``stop``
(`ChatRun.refusal`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slotserve.engine import Engine, Finished
from slotserve.server.chat.reply import ReplyShape, ReplyStream, call_id, read_reply
from slotserve.server.chat.run import ChatRun, start_chat
from slotserve.server.http.errors import APIError, error_body
from slotserve.server.http.generation import Outcome, collect, merged
from slotserve.server.http.state import ServerState
from slotserve.server.openai import replies as fmt
from slotserve.server.openai.llama_timings import at_end, at_token
from slotserve.server.openai.schemas import ChatCompletionRequest


async def generate_chat(
    state: ServerState, engine: Engine, body: ChatCompletionRequest, request: Request
) -> Response:
    """Run a chat completion request: a JSON answer or an SSE stream."""
    request_id, created = state.response_id("chatcmpl"), int(time.time())
    run = await start_chat(state, engine, body, request)
    head = fmt.envelope("chat.completion", request_id, created, state.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        stream = _stream(engine, run, head, body, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    outcomes = await collect(run.handles, request)
    return JSONResponse(_complete(engine, outcomes, run, head, body))


def _finish_reason(final: Finished, called: bool) -> str:
    return "tool_calls" if called and final.reason == "stop" else fmt.FINISH_REASONS[final.reason]


def _message(shape: ReplyShape, outcome: Outcome) -> dict[str, Any]:
    """The assistant message of a whole reply (`chat.reply.read_reply`)."""
    reply = read_reply(shape, outcome.events)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        assert shape.syntax is not None  # calls are only read for a syntax
        message["content"] = reply.content or None
        message["tool_calls"] = [
            {
                "id": call_id(shape.syntax),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in reply.calls
        ]
    return message


def _complete(
    engine: Engine,
    outcomes: list[Outcome],
    run: ChatRun,
    head: dict[str, Any],
    body: ChatCompletionRequest,
) -> dict[str, Any]:
    finals: list[Finished] = []
    choices = []
    wants_logprobs = body.logprobs_count() is not None
    for index, outcome in enumerate(outcomes):
        final = outcome.final
        assert final is not None  # collect waits for every choice's end
        run.check(final)
        finals.append(final)
        message = _message(run.shape, outcome)
        logprobs = (
            fmt.chat_logprobs(engine.model.tokenizer, outcome.events) if wants_logprobs else None
        )
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": _finish_reason(final, "tool_calls" in message),
                "logprobs": logprobs,
            }
        )
    whole = {**head, "choices": choices, "usage": fmt.usage(finals)}
    if body.timings_per_token and len(finals) == 1:  # `llama_timings`
        whole["timings"] = at_end(finals[0])
    return whole


def _chat_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A `ReplyStream` delta in chat's words (``reasoning`` is ``reasoning_content``)."""
    if "reasoning" in delta:
        return {"reasoning_content": delta["reasoning"]}
    return delta


async def _stream(
    engine: Engine,
    run: ChatRun,
    head: dict[str, Any],
    body: ChatCompletionRequest,
    include_usage: bool,
) -> AsyncIterator[str]:
    tokenizer = engine.model.tokenizer
    wants_logprobs = body.logprobs_count() is not None
    replies = [ReplyStream(run.shape) for _ in run.handles]
    finals: list[Finished] = []
    if include_usage:
        head = {**head, "usage": None}  # every chunk but the last, as OpenAI streams

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        logprobs: Any,
        timings: dict[str, Any] | None = None,
    ) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        extra = {"timings": timings} if timings is not None else {}
        return fmt.sse({**head, "choices": [choice], **extra})

    # The delta of a token that writes no text yet: in a plain reply, content that
    # completes no character yet; in a structured one, text not yet known to be
    # reasoning, content or a call.
    plain = run.shape.syntax is None and run.shape.reasoning is None
    held: dict[str, Any] = {"content": ""} if plain else {}
    opening = fmt.role_delta()
    per_token = bool(body.timings_per_token)
    for index in range(len(run.handles)):
        yield chunk(index, opening, None, None)
    # aclosing: the handles are cancelled as soon as the stream stops, even on an error.
    async with aclosing(merged(run.handles)) as events:
        try:
            async for index, event in events:
                reply = replies[index]
                if isinstance(event, Finished):
                    # A cut-short stream, or a document the grammar refuses (never "stop"),
                    # ends with an error event instead.
                    run.check(event)
                    finals.append(event)
                    timings = at_end(event) if per_token else None
                    for delta in reply.push("", final=True):
                        yield chunk(index, _chat_delta(delta), None, None, timings)
                    yield chunk(index, {}, _finish_reason(event, reply.called), None, timings)
                    continue
                logprobs = (
                    fmt.chat_logprobs(tokenizer, [event])
                    if wants_logprobs and event.token_id >= 0
                    else None
                )
                deltas = reply.push(run.shape.text(event))
                if not deltas and logprobs is not None:
                    deltas = [held]  # a token whose text is held back still has its logprobs
                timings = at_token(run.handles[index].timings, event) if per_token else None
                for delta in deltas:
                    yield chunk(index, _chat_delta(delta), None, logprobs, timings)
                    logprobs = None  # a token's logprobs ride on its first chunk
        except APIError as exc:
            yield fmt.sse(error_body(exc.message, exc.kind, exc.param, exc.code))
    if include_usage:
        last: dict[str, Any] = {"usage": fmt.usage(finals)}
        if per_token and len(finals) == 1:
            last["timings"] = at_end(finals[0])
        yield fmt.sse({**head, "choices": [], **last})
    yield fmt.sse("[DONE]")
