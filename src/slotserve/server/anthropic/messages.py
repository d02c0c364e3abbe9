"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat
machinery (`chat.run.start_chat`): the same engine, classes (``priority`` field or
``X-Priority``), admission and cancellation on disconnect.

A request's ``system``, text, ``tool_use`` and ``tool_result`` blocks become chat messages
(``thinking`` blocks sent back become the turn's ``reasoning_content``, which templates
that render past reasoning read; ``redacted_thinking`` is dropped), its
``tools`` (``input_schema``) chat's function tools, its ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``; ``disable_parallel_tool_use``) chat's, its ``thinking`` (``enabled``,
``adaptive`` or ``disabled``) the template's ``enable_thinking`` (``budget_tokens`` is not
enforced: ``max_tokens`` bounds the whole reply). slotserve's ``reasoning_format`` and
``chat_template_kwargs`` are chat's. The reply is `anthropic.reply`'s. Every failure is
that API's error shape, ``{"type": "error", "error": {"type", "message"}}``, with its
status (an admission refusal: 429 ``rate_limit_error``; a server shutting down: 529
``overloaded_error``; a missing or wrong key: 401 ``authentication_error``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from slotserve.engine import Engine
from slotserve.engine.events import Priority
from slotserve.server.anthropic.reply import ERROR_TYPES, MessageReply
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.chat.run import chat_prompt, start_chat
from slotserve.server.http.errors import APIError
from slotserve.server.http.generation import collect
from slotserve.server.http.security import KeyedRoute
from slotserve.server.http.state import ServerState
from slotserve.server.http.validation import describe, json_kind
from slotserve.server.openai.peer_fields import (
    ANTHROPIC_NO_OPS,
    ANTHROPIC_UNSUPPORTED,
    ignored_fields,
    refused_in,
)
from slotserve.server.openai.schemas import UNSUPPORTED_PARAMETER, Body, ChatCompletionRequest


class _AnthropicBody(Body):
    """A Messages API body: Anthropic's fields this server does not implement refused
    unless their value asks for nothing (`peer_fields.ANTHROPIC_UNSUPPORTED`), its hints
    accepted (`peer_fields.ANTHROPIC_NO_OPS`), and fields no API defines kept apart
    (``model_extra``) to be reported (`ignored`), never used."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        refused = refused_in(ANTHROPIC_UNSUPPORTED, data) if isinstance(data, dict) else None
        if refused is not None:
            raise PydanticCustomError(
                UNSUPPORTED_PARAMETER,
                "{param}: this server does not support this parameter (value {value}); remove it",
                {"param": refused[0], "value": json.dumps(refused[1])[:80]},
            )
        return data

    def ignored(self) -> list[str]:
        """The fields of the request no API defines (reported, never used)."""
        return ignored_fields(self.model_extra, ANTHROPIC_NO_OPS | set(ANTHROPIC_UNSUPPORTED))


class MessagesRequest(_AnthropicBody):
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
    thinking: dict[str, Any] | None = None
    reasoning_format: ReasoningFormat | None = None  # slotserve's, as in chat
    chat_template_kwargs: dict[str, Any] | None = None  # slotserve's, as in chat


class CountTokensRequest(_AnthropicBody):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # slotserve's, as in chat


THINKING_TYPES = ("enabled", "adaptive", "disabled")


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    status = 529 if status == 503 else status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status, headers=headers)


class AnthropicRoute(KeyedRoute):
    """A Messages API route: a request refused from its head (a missing or wrong key) is
    answered in that API's error shape (401 ``authentication_error``)."""

    def refuse(self, error: APIError) -> Response:
        return error_response(error.status, error.message, error.headers)


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
    """``system`` and ``messages`` as chat messages. A ``tool_result`` must answer a
    ``tool_use`` block of an earlier turn (a 400 naming its ``tool_use_id``)."""
    messages: list[dict[str, Any]] = []
    used: set[str] = set()  # the tool_use ids of the turns so far
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
        thoughts: list[str] = []
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
                used.add(call_id)
            elif kind == "thinking" and role == "assistant":
                thoughts.append(_field(block, "thinking", str, param, ""))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by its writer: nothing here can render it
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content"), f"{param}.content")
                if _field(block, "is_error", bool, param, False):
                    result = f"error: {result}"
                use_id = _field(block, "tool_use_id", str, param)
                if use_id not in used:
                    reason = f"{use_id!r} answers no tool_use block of an earlier turn"
                    raise _refuse(f"{param}.tool_use_id", reason)
                answer = {"role": "tool", "tool_call_id": use_id}
                messages.append({**answer, "content": result})
            else:
                raise _refuse(f"{param}.type", f"{kind!r} blocks are not supported in {role} turns")
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if thoughts:  # past thinking, as the template reads it (`tools.template_input`)
            turn["reasoning_content"] = "\n".join(thoughts)
        if calls:
            messages.append({**turn, "tool_calls": calls})
        elif texts or thoughts or not content:
            messages.append(turn)
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


def _template_kwargs(body: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """The chat template's variables: ``chat_template_kwargs``, with ``thinking`` as
    ``enable_thinking``."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None:
        kind = _field(body.thinking, "type", str, "thinking")
        if kind not in THINKING_TYPES:
            raise _refuse("thinking.type", f"{kind!r} is not one of {', '.join(THINKING_TYPES)}")
        kwargs["enable_thinking"] = kind != "disabled"
    return kwargs or None


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    fields |= chat_tools(body)
    fields["chat_template_kwargs"] = _template_kwargs(body)
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences or None,
            "priority": body.priority,
            "reasoning_format": body.reasoning_format,
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
    reply = MessageReply(state, engine, body, run)
    if body.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    (outcome,) = await collect(run.handles, request)
    assert outcome.final is not None
    run.check(outcome.final)
    return JSONResponse(reply.whole(outcome.events, outcome.final))
