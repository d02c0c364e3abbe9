"""The request side of ``/v1/responses``: its body (`ResponsesRequest`, strictly typed as
every body is: `schemas.Body`) and the chat completion it asks for (`chat_request`).

A request's ``input`` (a string, or message, ``function_call`` and ``function_call_output``
items) becomes chat messages after its ``instructions`` and, with ``previous_response_id``,
after the stored conversation of that response; its flat function tools become chat's
function tools, ``text.format`` chat's ``response_format``; slotserve's ``reasoning_format``
and ``chat_template_kwargs`` (`reasoning`) are chat's. A reasoning item sent back is
dropped (templates render no past reasoning). Every refusal is a 400 whose
``param`` names the field as the client sent it (``input.2.content.0.text``), never chat's
name for it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from slotserve.engine.events import Priority
from slotserve.server.errors import APIError
from slotserve.server.reasoning import ReasoningFormat
from slotserve.server.schemas import Body, ChatCompletionRequest
from slotserve.server.validation import describe, json_kind

INVALID = "invalid_request_error"


class ResponsesRequest(Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: Priority | None = None  # slotserve's: the request's class
    seed: int | None = None  # slotserve's, as in chat
    reasoning_format: ReasoningFormat | None = None  # slotserve's, as in chat
    chat_template_kwargs: dict[str, Any] | None = None  # slotserve's, as in chat


def refuse(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", INVALID, param)


def _string(item: dict[str, Any], key: str, param: str) -> Any:
    """``item[key]`` when absent or a string; anything else is a 400 naming it."""
    value = item.get(key)
    if key in item and not isinstance(value, str):
        raise refuse(f"{param}.{key}", f"expected a string, got {json_kind(value)}")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items become one assistant
    message's tool calls, ``function_call_output`` items tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input.{index}"
        kind = _string(item, "type", param) or "message"
        if kind == "message":
            messages.append(_message_of(item, param))
        elif kind == "function_call":
            function = {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            }
            call = {"id": _string(item, "call_id", param), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            call_id = _string(item, "call_id", param)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # a reasoning item sent back: the template renders no past reasoning
        else:
            raise refuse(f"{param}.type", f"items of type {kind!r} are not supported")
    return messages


def _message_of(item: dict[str, Any], param: str) -> dict[str, Any]:
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise refuse(f"{param}.content.{index}", "only text parts are supported")
            texts.append(_string(part, "text", f"{param}.content.{index}") or "")
        content = "\n".join(texts)
    return {"role": item.get("role"), "content": content}


def chat_tools(body: ResponsesRequest) -> dict[str, Any]:
    """The Responses' flat function tools and tool choice in chat's shape."""
    fields: dict[str, Any] = {}
    if body.tools is not None:
        tools = []
        for index, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise refuse(f"tools.{index}.type", f"{tool.get('type')!r} tools are not supported")
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = _string(choice, "name", "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    return fields


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form.get("type") == "json_schema":
        schema = {"name": form.get("name"), "schema": form.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": form.get("type")}


# Chat's fields that the Responses API names otherwise.
_RESPONSES_NAME = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(
    body: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat completion ``body`` asks for; a field chat refuses is a 400 naming it."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {
        "model": body.model,
        "messages": system + conversation,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "priority": body.priority,
        "response_format": _response_format(body.text),
        "reasoning_format": body.reasoning_format,
        "chat_template_kwargs": body.chat_template_kwargs,
        **chat_tools(body),
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        failure = describe(exc.errors())
        error = APIError(400, failure.message, INVALID, failure.param or "input")
        offset = len(fields["messages"]) - len(input_messages(body.input))
        raise input_error(error, offset) from None


def input_error(exc: APIError, offset: int) -> APIError:
    """``exc`` naming the request's fields where it names chat's: ``input`` for
    ``messages`` (message ``offset`` is this request's first input message),
    ``max_output_tokens`` for ``max_tokens``, a flat tool's field for chat's
    ``tools.N.function.…``."""
    param = exc.param or ""
    if param.startswith("messages."):
        head, _, rest = param[len("messages.") :].partition(".")
        index = int(head) - offset if head.isdigit() else head
        renamed = f"input.{index}" + (f".{rest}" if rest else "")
    elif param.startswith("tools.") and ".function." in param:  # its tools are flat
        renamed = param.replace(".function.", ".", 1)
    else:
        head, dot, rest = param.partition(".")
        renamed = _RESPONSES_NAME.get(head, head) + dot + rest
    if renamed == param:
        return exc
    message = exc.message.replace(param, renamed, 1)
    return APIError(exc.status, message, exc.kind, renamed, exc.code, exc.headers)
