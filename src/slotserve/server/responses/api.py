"""``/v1/responses``: OpenAI's Responses API over the chat machinery.

A request's ``input`` becomes a chat request (`responses.request`) after its ``instructions``
and, with ``previous_response_id``, after the stored conversation of that response
(`ResponseStore`: instructions never carry over). It then runs as a chat completion does
(`chat.run.start_chat`: the chat template, tools, the grammar, the engine). Its reply is
output items (`responses.events`): a reasoning item for a thinking model's section
(`reasoning`), a message with ``output_text``, and ``function_call`` items, whole or
streamed as the API's events (``response.created`` … ``response.output_text.delta`` …
``response.completed``).

A continuation is served from the prefix cache: each turn keeps its prompt and reply in the
engine's cache (``publish_completion``), and the next turn's prompt begins with exactly
those tokens, so only the new turn is computed (``usage.input_tokens_details.cached_tokens``
says how much was not); two continuations of one response restore the same snapshot,
sharing its blocks. ``store: false`` keeps nothing here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slotserve.engine import Engine, Finished, TokenEvent
from slotserve.server.chat.reply import ReplyShape, ReplyStream, read_reply
from slotserve.server.chat.run import ChatRun, start_chat
from slotserve.server.http.errors import APIError
from slotserve.server.http.generation import collect, merged
from slotserve.server.http.state import ServerState
from slotserve.server.responses.custom import (
    custom_item,
    custom_names,
    input_of,
    lark_arguments,
)
from slotserve.server.responses.events import (
    EventWriter,
    assistant_messages,
    function_item,
    message_item,
    reasoning_item,
)
from slotserve.server.responses.request import (
    FieldNames,
    ResponsesRequest,
    chat_request,
    input_messages,
    refuse,
)
from slotserve.server.responses.store import StoredResponse

log = logging.getLogger("slotserve")


async def create_response(
    state: ServerState, engine: Engine, body: ResponsesRequest, request: Request
) -> Response:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            message = (
                f"no stored response has id {body.previous_response_id!r} "
                f"({state.responses.describe()})"
            )
            raise refuse("previous_response_id", message)
        history = [dict(m) for m in stored.conversation]
    given = input_messages(body.input)
    names = FieldNames(body, len(history), given)
    conversation = history + given.messages
    chat = chat_request(body, conversation, names)
    lark = lark_arguments(body.tools)
    try:
        run = await start_chat(state, engine, chat, request, "input", lark)
    except APIError as exc:  # chat's names for the fields: say the client's
        raise names.renamed(exc) from None
    turn = _Turn(state, body, conversation, run.shape)
    if body.stream:
        return StreamingResponse(turn.stream(run, names), media_type="text/event-stream")
    (outcome,) = await collect(run.handles, request)
    assert outcome.final is not None
    try:
        run.check(outcome.final)
    except APIError as exc:
        raise names.renamed(exc) from None
    turn.finish(outcome.events, outcome.final)
    return JSONResponse(turn.response)


class _Turn:
    """One response as it is made: its output items, its object, its storing."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        shape: ReplyShape,
    ) -> None:
        self.state, self.body, self.conversation, self.shape = state, body, conversation, shape
        self.custom = custom_names(body.tools)
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.response = self._object("in_progress", [], None)

    def _object(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = self.body
        tools = [
            t
            if t.get("type") == "custom"
            else {"type": "function", "strict": None, **{k: v for k, v in t.items() if k != "type"}}
            for t in body.tools or []
        ]
        # The spec's Response.usage is optional, not nullable: left out until it is known.
        counted = {} if usage is None else {"usage": usage}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.state.model_name,
            "output": output,
            "instructions": body.instructions,
            "tools": tools,
            "tool_choice": body.tool_choice or ("auto" if tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "store": body.store,
            "error": None,
            "incomplete_details": None,
            **counted,
        }

    def finish(self, events: list[TokenEvent], final: Finished) -> None:
        """Complete the response object from the whole reply, and store it."""
        reply = read_reply(self.shape, events)
        items: list[dict[str, Any]] = []
        if reply.reasoning is not None:
            items.append(reasoning_item(reply.reasoning))
        if reply.content or not reply.calls:
            items.append(message_item(reply.content))
        for index, (name, arguments) in enumerate(reply.calls):
            cut = reply.cut and index == len(reply.calls) - 1  # as the stream closes it
            if name in self.custom:
                items.append(custom_item(name, input_of(arguments)))
            else:
                items.append(function_item(name, arguments, "incomplete" if cut else "completed"))
        self.complete(items, final, reply.reasoning_tokens)

    def complete(self, output: list[dict[str, Any]], final: Finished, reasoning: int) -> None:
        cut = final.reason == "length"
        usage = final.usage
        self.response = self._object(
            "incomplete" if cut else "completed",
            output,
            {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": usage.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage.total_tokens,
            },
        )
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.body.store:
            reply = assistant_messages(output)
            stored = StoredResponse(self.conversation + reply, self.response)
            if not self.state.responses.put(self.response_id, stored):
                log.warning(
                    "response %s is not stored: it alone is larger than the budget (%s)",
                    self.response_id,
                    self.state.responses.describe(),
                )

    async def stream(self, run: ChatRun, names: FieldNames) -> AsyncIterator[str]:
        events = EventWriter(self.custom)
        yield events.send("response.created", response=self.response)
        yield events.send("response.in_progress", response=self.response)
        reply = ReplyStream(self.shape)
        async with aclosing(merged(run.handles)) as stream:
            try:
                async for _, event in stream:
                    if isinstance(event, Finished):
                        run.check(event)
                        for line in events.deltas(reply.push("", final=True)):
                            yield line
                        for line in events.close_item(event.reason != "length"):
                            yield line
                        self.complete(events.items, event, reply.reasoning_tokens)
                        yield events.send(
                            "response.incomplete"
                            if self.response["status"] == "incomplete"
                            else "response.completed",
                            response=self.response,
                        )
                        continue
                    for line in events.deltas(reply.push(self.shape.text(event))):
                        yield line
            except APIError as exc:  # in the client's names for its fields
                exc = names.renamed(exc)
                error = {"code": exc.code or exc.kind, "message": exc.message, "param": exc.param}
                yield events.send("error", **error)
