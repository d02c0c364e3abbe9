"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat
machinery (`chat_run.start_chat`): the same engine, classes (``priority`` field or
``X-Priority``), admission and cancellation on disconnect.

A request's ``system``, text, ``tool_use`` and ``tool_result`` blocks become chat messages,
its ``tools`` (``input_schema``) chat's function tools, its ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``; ``disable_parallel_tool_use``) chat's. The reply is text and
``tool_use`` blocks with ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence``
or ``tool_use``, whole or streamed as the API's events (``message_start``,
``content_block_start``/``delta``/``stop``, ``message_delta``, ``message_stop``). Every
failure is that API's error shape, ``{"type": "error", "error": {"type", "message"}}``,
with its status (an admission refusal: 429 ``rate_limit_error``; a server shutting down:
529 ``overloaded_error``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from slotserve.engine import Engine, Finished
from slotserve.engine.events import Priority
from slotserve.server.chat_run import ChatRun, chat_prompt, start_chat
from slotserve.server.completions import check_finish
from slotserve.server.errors import APIError
from slotserve.server.generation import collect, merged
from slotserve.server.schemas import Body, ChatCompletionRequest
from slotserve.server.state import ServerState
from slotserve.server.tool_calls import CallStream, parse_reply
from slotserve.server.validation import describe, json_kind

# HTTP status → Anthropic's error type; 503 (shutting down, still loading) is its 529.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class MessagesRequest(Body):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    priority: Priority | None = None  # slotserve's: the request's class


class CountTokensRequest(Body):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    status = 529 if status == 503 else status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status, headers=headers)


def _refuse(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", "invalid_request_error", param)


async def parsed(request: Request, model: type[Body]) -> Any:
    """The request body as ``model``; invalid JSON or fields are a 400 naming them."""
    try:
        raw = await request.json()
    except ValueError:
        raise _refuse("body", "the request body is not valid JSON") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> APIError:
    """The 400 for a body that fails its types: the message names the field."""
    failure = describe(exc.errors())
    return APIError(400, failure.message, "invalid_request_error", failure.param or "body")


def _field(block: dict[str, Any], key: str, kind: type, param: str, default: Any = None) -> Any:
    """``block[key]``, which must be of JSON type ``kind`` (strictly: a boolean is not an
    integer), else a 400 naming ``param.key``; ``default`` when it is absent."""
    if key not in block:
        return default
    value = block[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = {str: "a string", dict: "an object", bool: "a boolean", list: "an array"}
        raise _refuse(f"{param}.{key}", f"expected {expected[kind]}, got {json_kind(value)}")
    return value


def _text(content: Any, param: str) -> str:
    """A block's content as text: a string, or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for index, block in enumerate(content if isinstance(content, list) else [content]):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _refuse(f"{param}.{index}", "only text blocks are supported here")
        texts.append(_field(block, "text", str, f"{param}.{index}", ""))
    return "\n".join(texts)


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for index, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise _refuse(f"messages.{index}.role", f"{role!r} is not user or assistant")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _refuse(f"messages.{index}.content", "give a string or a list of blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for place, block in enumerate(content):
            param = f"messages.{index}.content.{place}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_field(block, "text", str, param, ""))
            elif kind == "tool_use" and role == "assistant":
                arguments = json.dumps(_field(block, "input", dict, param, {}), ensure_ascii=False)
                function = {"name": _field(block, "name", str, param), "arguments": arguments}
                call_id = _field(block, "id", str, param)
                calls.append({"id": call_id, "type": "function", "function": function})
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content"), f"{param}.content")
                if _field(block, "is_error", bool, param, False):
                    result = f"error: {result}"
                answer = {"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, param)}
                messages.append({**answer, "content": result})
            else:
                raise _refuse(f"{param}.type", f"{kind!r} blocks are not supported in {role} turns")
        if calls:
            messages.append({"role": "assistant", "content": "\n".join(texts), "tool_calls": calls})
        elif texts or not content:
            messages.append({"role": role, "content": "\n".join(texts)})
    return messages


def chat_tools(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools is not None:
        tools = []
        for index, tool in enumerate(body.tools):
            if tool.get("type", "custom") != "custom":
                raise _refuse(
                    f"tools.{index}.type", f"{tool.get('type')!r} tools are not supported"
                )
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = body.tool_choice
    if choice is not None:
        kind = choice.get("type")
        named = {"type": "function", "function": {"name": choice.get("name")}}
        chosen = {"auto": "auto", "any": "required", "none": "none", "tool": named}.get(kind or "")
        if chosen is None:
            raise _refuse("tool_choice.type", f"{kind!r} is not auto, any, tool or none")
        fields["tool_choice"] = chosen
        if _field(choice, "disable_parallel_tool_use", bool, "tool_choice", False):
            fields["parallel_tool_calls"] = False
    return fields


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    fields |= chat_tools(body)
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences or None,
            "priority": body.priority,
        }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(exc) from None


async def count_tokens(engine: Engine, body: CountTokensRequest) -> dict[str, Any]:
    tokens, _ = chat_prompt(engine, chat_request(body), "messages")
    return {"input_tokens": len(tokens)}


async def create_message(
    state: ServerState, engine: Engine, body: MessagesRequest, request: Request
) -> Response:
    chat = chat_request(body)
    run = await start_chat(state, engine, chat, request)
    reply = _Reply(state, engine, body, run)
    if body.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    (outcome,) = await collect(run.handles, request)
    assert outcome.final is not None
    check_finish(outcome.final)
    return JSONResponse(reply.whole(run.text(outcome.events), outcome.final))


class _Reply:
    """One message as it is made."""

    def __init__(self, state: ServerState, engine: Engine, body: MessagesRequest, run: ChatRun):
        self.state, self.engine, self.body, self.run = state, engine, body, run
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"

    def message(self, content: list[dict[str, Any]], final: Finished | None) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop(final, content) if final else (None, None)
        output = final.usage.completion_tokens if final else 0
        usage = {
            "input_tokens": self.run.prompt_tokens,
            "output_tokens": output,
            "cache_read_input_tokens": final.usage.cached_tokens if final else 0,
            "cache_creation_input_tokens": 0,
        }
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def stop(self, final: Finished, content: list[dict[str, Any]]) -> tuple[str, str | None]:
        if final.reason == "length":
            return "max_tokens", None
        if any(block["type"] == "tool_use" for block in content):
            return "tool_use", None
        stops = self.body.stop_sequences or []
        if final.eos_token is None and stops:  # a stop sequence ended it: which one
            rest = self.engine.model.tokenizer.decode(list(final.tokens))[len(final.text) :]
            found = min(stops, key=lambda s: (rest.find(s) if s in rest else len(rest), -len(s)))
            return "stop_sequence", found
        return "end_turn", None

    def whole(self, text: str, final: Finished) -> dict[str, Any]:
        plan = self.run.plan
        content_text, calls = parse_reply(plan.syntax, text) if plan else (final.text, [])
        blocks: list[dict[str, Any]] = []
        if content_text or not calls:
            blocks.append({"type": "text", "text": content_text})
        blocks += [tool_use(name, arguments) for name, arguments in calls]
        return self.message(blocks, final)

    async def stream(self) -> AsyncIterator[str]:
        yield event("message_start", message=self.message([], None))
        blocks: list[dict[str, Any]] = []
        open_kind: str | None = None
        reply = CallStream(self.run.plan.syntax) if self.run.plan is not None else None
        async with aclosing(merged(self.run.handles)) as events:
            try:
                async for _, item in events:
                    if isinstance(item, Finished):
                        check_finish(item)
                        deltas = reply.push("", final=True) if reply is not None else []
                    else:
                        text = item.text + self.run.markers.get(item.token_id, "")
                        deltas = reply.push(text) if reply is not None else [{"content": text}]
                    for delta in deltas:
                        if delta.get("content"):
                            if open_kind != "text":
                                if open_kind is not None:
                                    yield event("content_block_stop", index=len(blocks) - 1)
                                blocks.append({"type": "text", "text": ""})
                                open_kind = "text"
                                yield event(
                                    "content_block_start",
                                    index=len(blocks) - 1,
                                    content_block=blocks[-1],
                                )
                            blocks[-1]["text"] += delta["content"]
                            text_delta = {"type": "text_delta", "text": delta["content"]}
                            yield event(
                                "content_block_delta", index=len(blocks) - 1, delta=text_delta
                            )
                        for call in delta.get("tool_calls", []):
                            if "id" in call:
                                if open_kind is not None:
                                    yield event("content_block_stop", index=len(blocks) - 1)
                                block = tool_use(call["function"]["name"], "{}")
                                blocks.append({**block, "input": {}})
                                open_kind = "tool_use"
                                yield event(
                                    "content_block_start",
                                    index=len(blocks) - 1,
                                    content_block=blocks[-1],
                                )
                            fragment = call["function"].get("arguments", "")
                            if fragment:
                                json_delta = {"type": "input_json_delta", "partial_json": fragment}
                                yield event(
                                    "content_block_delta", index=len(blocks) - 1, delta=json_delta
                                )
                    if isinstance(item, Finished):
                        if open_kind is not None:
                            yield event("content_block_stop", index=len(blocks) - 1)
                        stop_reason, stop_sequence = self.stop(item, blocks)
                        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                        usage = {"output_tokens": item.usage.completion_tokens}
                        yield event("message_delta", delta=delta, usage=usage)
                        yield event("message_stop")
            except APIError as exc:
                status = 529 if exc.status == 503 else exc.status
                error = {"type": ERROR_TYPES.get(status, "api_error"), "message": exc.message}
                yield event("error", error=error)


def tool_use(name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": json.loads(arguments) if arguments else {},
    }


def event(kind: str, **fields: Any) -> str:
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"
