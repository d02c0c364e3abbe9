"""``/v1/responses``: OpenAI's Responses API over the chat machinery.

A request's ``input`` (a string, or message, ``function_call`` and ``function_call_output``
items) becomes chat messages after its ``instructions`` and, with ``previous_response_id``,
after the stored conversation of that response (`ResponseStore`: instructions never carry
over). It then runs as a chat completion does: the chat template, tools through `tools`
(the Responses' flat function tools), the engine. Its reply is output items: a message with
``output_text`` and ``function_call`` items, whole or streamed as the API's events
(``response.created`` … ``response.output_text.delta`` … ``response.completed``).

A continuation is served from the prefix cache: each turn keeps its prompt and reply in the
engine's cache (``publish_completion``), and the next turn's prompt begins with exactly
those tokens, so only the new turn is computed (``usage.input_tokens_details.cached_tokens``
says how much was not); two continuations of one response restore the same snapshot,
sharing its blocks. ``store: false`` keeps nothing here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slotserve.engine import Engine, Finished, TokenEvent
from slotserve.sampling import Grammar
from slotserve.server import responses as fmt
from slotserve.server.completions import (
    chat_tokens,
    check_finish,
    priority_of,
    prompt_tokens,
    sampling_params,
)
from slotserve.server.errors import APIError
from slotserve.server.generation import collect, merged, submit_all
from slotserve.server.response_store import StoredResponse
from slotserve.server.responses_input import (
    ResponsesRequest,
    chat_request,
    input_error,
    input_messages,
    refuse,
)
from slotserve.server.state import ServerState
from slotserve.server.structured import logit_bias, response_grammar
from slotserve.server.tool_calls import CallStream, parse_reply, reply_text
from slotserve.server.tools import ToolPlan, plan_tools, tool_grammar


async def create_response(
    state: ServerState, engine: Engine, body: ResponsesRequest, request: Request
) -> Response:
    conversation: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            message = f"no stored response has id {body.previous_response_id!r}"
            raise refuse("previous_response_id", message)
        conversation = [dict(m) for m in stored.conversation]
    conversation += input_messages(body.input)
    chat = chat_request(body, conversation)
    tokenizer = engine.model.tokenizer
    try:
        plan = plan_tools(tokenizer, chat)
        prompt = chat_tokens(engine, chat.messages, add_generation_prompt=True, tools=plan)
    except APIError as exc:  # chat's names for the fields: say the client's
        raise input_error(exc, len(chat.messages) - len(input_messages(body.input))) from None
    tokens = prompt_tokens(engine, prompt, "input")
    grammars = state.grammars_of(engine)
    grammar: Grammar | None
    if plan is not None:
        grammar = await tool_grammar(grammars, plan, tokenizer)
    else:
        grammar = await response_grammar(grammars, chat)
    room = engine.config.max_context - len(tokens)
    params = [sampling_params(chat, room, 0, state.sampling, grammar, logit_bias(engine, chat))]
    handles = submit_all(
        engine, tokens, params, priority_of(chat, request), "input", keep_conversation=True
    )
    turn = _Turn(state, body, conversation, plan, tokenizer)
    if body.stream:
        return StreamingResponse(turn.stream(handles), media_type="text/event-stream")
    (outcome,) = await collect(handles, request)
    assert outcome.final is not None
    check_finish(outcome.final)
    turn.finish(outcome.events, outcome.final)
    return JSONResponse(turn.response)


class _Turn:
    """One response as it is made: its output items, its object, its storing."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        plan: ToolPlan | None,
        tokenizer: Any,
    ) -> None:
        self.state, self.body, self.conversation, self.plan = state, body, conversation, plan
        self.markers = (
            {t: text for text, t in plan.specials(tokenizer).items()} if plan is not None else {}
        )
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.response = self._object("in_progress", [], None)

    def _object(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = self.body
        tools = [
            {"type": "function", "strict": None, **{k: v for k, v in t.items() if k != "type"}}
            for t in body.tools or []
        ]
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
            "usage": usage,
        }

    def output(self, text: str) -> list[dict[str, Any]]:
        """The output items of a whole reply's ``text``."""
        content, calls = parse_reply(self.plan.syntax, text) if self.plan else (text, [])
        items: list[dict[str, Any]] = []
        if content or not calls:
            items.append(message_item(content or ""))
        items += [function_item(name, arguments) for name, arguments in calls]
        return items

    def finish(self, events: list[TokenEvent], final: Finished) -> None:
        """Complete the response object from the whole reply, and store it."""
        output = self.output(reply_text(events, self.markers) if self.plan else final.text)
        self.complete(output, final)

    def complete(self, output: list[dict[str, Any]], final: Finished) -> None:
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
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
        )
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.body.store:
            reply = _assistant_messages(output)
            stored = StoredResponse(self.conversation + reply, self.response)
            self.state.responses.put(self.response_id, stored)

    async def stream(self, handles: list[Any]) -> AsyncIterator[str]:
        events = _EventWriter(self)
        yield events.send("response.created", response=self.response)
        yield events.send("response.in_progress", response=self.response)
        reply = CallStream(self.plan.syntax) if self.plan is not None else None
        async with aclosing(merged(handles)) as stream:
            try:
                async for _, event in stream:
                    if isinstance(event, Finished):
                        check_finish(event)
                        deltas = reply.push("", final=True) if reply is not None else []
                        for line in events.deltas(deltas):
                            yield line
                        for line in events.close_item(event.reason != "length"):
                            yield line
                        self.complete(events.items, event)
                        yield events.send(
                            "response.incomplete"
                            if self.response["status"] == "incomplete"
                            else "response.completed",
                            response=self.response,
                        )
                        continue
                    text = event.text + self.markers.get(event.token_id, "")
                    deltas = reply.push(text) if reply is not None else [{"content": text}]
                    for line in events.deltas([d for d in deltas if d.get("content") != ""]):
                        yield line
            except APIError as exc:
                error = {"code": exc.code or exc.kind, "message": exc.message, "param": exc.param}
                yield events.send("error", **error)


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def function_item(name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's output items as the chat messages the next turn renders."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class _EventWriter:
    """The stream's events in order, numbered, with the output items they open and close."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n{fmt.sse(payload)}"

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def deltas(self, deltas: list[dict[str, Any]]) -> list[str]:
        lines: list[str] = []
        for delta in deltas:
            if "content" in delta:
                if self.open is None or self.open["type"] != "message":
                    lines += self.close_item()
                    lines += self._open(message_item("", "in_progress"))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    lines.append(self._part("response.content_part.added", part))
                assert self.open is not None
                self.open["text"] = self.open.get("text", "") + delta["content"]
                lines.append(
                    self._at("response.output_text.delta", delta=delta["content"], logprobs=[])
                )
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    lines += self.close_item()
                    function = call["function"]
                    lines += self._open(function_item(function["name"], "", "in_progress"))
                fragment = call["function"].get("arguments", "")
                if fragment:
                    assert self.open is not None
                    self.open["arguments"] += fragment
                    lines.append(self._at("response.function_call_arguments.delta", delta=fragment))
        return lines

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        return [self.send("response.output_item.added", output_index=self.index, item=item)]

    def _at(self, kind: str, **fields: Any) -> str:
        assert self.open is not None
        place = {"item_id": self.open["id"], "output_index": self.index}
        if self.open["type"] == "message":
            place["content_index"] = 0
        return self.send(kind, **place, **fields)

    def _part(self, kind: str, part: dict[str, Any]) -> str:
        return self._at(kind, part=part)

    def close_item(self, whole: bool = True) -> list[str]:
        """Close the open item (``whole``: completed, else incomplete: the budget ran out)."""
        item = self.open
        if item is None:
            return []
        self.open = None
        lines: list[str] = []
        if item["type"] == "message":
            text = item.pop("text", "")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self.open = item  # for the place of the closing events
            lines.append(self._at("response.output_text.done", text=text, logprobs=[]))
            lines.append(self._part("response.content_part.done", part))
            self.open = None
            item["content"] = [part]
        else:
            self.open = item
            lines.append(
                self._at("response.function_call_arguments.done", arguments=item["arguments"])
            )
            self.open = None
        item["status"] = "completed" if whole else "incomplete"
        lines.append(
            self.send("response.output_item.done", output_index=self.items.index(item), item=item)
        )
        return lines
