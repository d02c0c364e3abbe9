"""The request side of ``/v1/responses``: its body (`ResponsesRequest`, strictly typed as
every body is: `schemas.Body`) and the chat completion it asks for (`chat_request`).

A request's ``input`` (a string, or message, ``function_call`` and ``function_call_output``
items) becomes chat messages after its ``instructions`` and, with ``previous_response_id``,
after the stored conversation of that response; its flat function tools become chat's
function tools, ``text.format`` chat's ``response_format``; slotserve's ``reasoning_format``
and ``chat_template_kwargs`` (`reasoning`) are chat's. A reasoning item sent back becomes
the next assistant turn's ``reasoning_content`` (what templates that render past reasoning
read).

Every refusal is a 400 whose ``param`` names the field as the client sent it, never chat's
name for it: each chat message remembers the item it came from (`Source`), so chat's
``messages.3.tool_calls.1.function.arguments`` is the request's ``input.5.arguments``
(`FieldNames`). ``metadata`` is bounded as OpenAI bounds it (the store keeps it). Fields
this server does not implement (``background``, ``conversation``, ``include``,
``truncation``, and those of `peer_fields.RESPONSES_UNSUPPORTED`) are refused (400
``unsupported_parameter`` naming the field) unless their value asks for the default
behaviour; hints that change no output (`peer_fields.RESPONSES_NO_OPS`) are accepted; a
field no API defines is reported (`ignored`: the route's ``X-Slotserve-Ignored-Fields``
header, and a log line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from slotserve.engine.events import Priority
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.http.errors import APIError
from slotserve.server.http.validation import describe, json_kind
from slotserve.server.openai.peer_fields import (
    RESPONSES_NO_OPS,
    RESPONSES_UNSUPPORTED,
    ignored_fields,
    refused_in,
)
from slotserve.server.openai.schemas import UNSUPPORTED_PARAMETER, Body, ChatCompletionRequest
from slotserve.server.responses.custom import call_arguments, custom_function

INVALID = "invalid_request_error"
# OpenAI's bounds on ``metadata``: pairs, and characters in a key and in a value.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
# The roles an input message may have (chat's ``tool`` is a function_call_output item).
ROLES = ("user", "assistant", "system", "developer")
# The Responses API's fields this server does not implement: the test for values that ask
# only for what it does anyway, and those values in words. Any other value is refused.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (
        lambda value: value is None or value is False,
        "false (a response is made within its request)",
    ),
    "conversation": (
        lambda value: value is None,
        "null (continue a response with previous_response_id)",
    ),
    "include": (lambda value: value is None or value == [], "[] or null (no extra output)"),
    "truncation": (
        lambda value: value is None or value == "disabled",
        '"disabled" (an input longer than the context is refused, never cut)',
    ),
}


class ResponsesRequest(Body):
    """A ``/v1/responses`` body. Fields no API defines are kept apart (``model_extra``) to
    be reported (`ignored`), never used."""

    model_config = ConfigDict(extra="allow", strict=True)

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

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        for name, (harmless, supported) in UNSUPPORTED.items():
            if isinstance(data, dict) and name in data and not harmless(data[name]):
                raise PydanticCustomError(
                    UNSUPPORTED_PARAMETER,
                    "{param}: this server supports only {supported}, got {value}; remove it",
                    {"param": name, "supported": supported, "value": _shown(data[name])},
                )
        refused = refused_in(RESPONSES_UNSUPPORTED, data) if isinstance(data, dict) else None
        if refused is not None:
            raise PydanticCustomError(
                UNSUPPORTED_PARAMETER,
                "{param}: this server does not support this parameter (value {value}); remove it",
                {"param": refused[0], "value": _shown(refused[1])},
            )
        return data

    def ignored(self) -> list[str]:
        """The fields of the request no API defines (reported, never used)."""
        return ignored_fields(self.model_extra, RESPONSES_NO_OPS | set(RESPONSES_UNSUPPORTED))

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        pairs = value or {}
        if len(pairs) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} key-value pairs, got {len(pairs)}")
        for key, text in pairs.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(
                    f"a key has at most {METADATA_KEY_CHARS} characters, got {len(key)} "
                    f"({_shown(key)})"
                )
            if len(text) > METADATA_VALUE_CHARS:
                reason = f"a value has at most {METADATA_VALUE_CHARS} characters, got {len(text)}"
                raise _Inside(reason, (key,))
        return value


class _Inside(ValueError):
    """A refusal of one place inside a field's value: ``path`` (keys and indices) is added
    to the field's name in ``param`` (`validation.describe`, as for `schemas.InvalidText`)."""

    def __init__(self, message: str, path: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.path = path


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", INVALID, param)


def _string(item: dict[str, Any], key: str, param: str) -> Any:
    """``item[key]`` when absent or a string; anything else is a 400 naming it."""
    value = item.get(key)
    if key in item and not isinstance(value, str):
        raise refuse(f"{param}.{key}", f"expected a string, got {json_kind(value)}")
    return value


SourceKind = Literal["instructions", "stored", "message", "function_call", "function_call_output"]
# A function_call item's fields by chat's names for them (under ``tool_calls.N``).
_CALL_FIELDS = {
    "id": "call_id",
    "type": "type",
    "function.name": "name",
    "function.arguments": "arguments",
}
# A function_call_output item's fields by chat's names for them (of a tool message).
_OUTPUT_FIELDS = {"tool_call_id": "call_id", "content": "output"}


@dataclass
class Source:
    """Where one chat message came from: ``param``, the request's field or ``input`` item
    (``instructions``, ``previous_response_id``, ``input`` for a string, ``input.2``), of
    ``kind``; for a message of ``function_call`` items, ``calls`` holds each call's item."""

    kind: SourceKind
    param: str
    calls: list[str] = field(default_factory=list)

    def name(self, rest: str) -> str:
        """The request's name for chat's ``messages.N`` + ``rest`` of this message."""
        if self.kind == "function_call":
            place, _, inner = rest.removeprefix("tool_calls.").partition(".")
            if rest.startswith("tool_calls.") and place.isdigit() and int(place) < len(self.calls):
                return _joined(self.calls[int(place)], _CALL_FIELDS.get(inner, ""))
            return self.calls[0]
        if self.kind == "function_call_output":
            return _joined(self.param, _OUTPUT_FIELDS.get(rest.partition(".")[0], ""))
        if self.kind == "message" and self.param != "input":
            return _joined(self.param, rest)
        return self.param  # the instructions, a stored message, a string input


def _joined(param: str, rest: str) -> str:
    return f"{param}.{rest}" if rest else param


@dataclass
class InputMessages:
    """``input`` as chat messages, each with its `Source`."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)

    def add(self, message: dict[str, Any], source: Source) -> None:
        self.messages.append(message)
        self.sources.append(source)


def input_messages(items: str | list[dict[str, Any]]) -> InputMessages:
    """``input`` as chat messages: consecutive ``function_call`` items become one assistant
    message's tool calls, ``function_call_output`` items tool messages."""
    turn = InputMessages()
    if isinstance(items, str):
        turn.add({"role": "user", "content": items}, Source("message", "input"))
        return turn
    thinking: list[str] = []  # reasoning items not yet given to an assistant turn
    for index, item in enumerate(items):
        param = f"input.{index}"
        kind = _string(item, "type", param) or "message"
        if kind in _CUSTOM_KINDS:  # a custom tool's call and output, as a function's
            item, kind = _as_function_item(item, param), _CUSTOM_KINDS[kind]
        opens = kind == "function_call" or (kind == "message" and item.get("role") == "assistant")
        joins = kind == "function_call" and bool(turn.sources) and turn.sources[-1].kind == kind
        past: dict[str, str] = {}  # the new assistant turn's reasoning_content
        if thinking and opens and not joins:
            past, thinking = {"reasoning_content": "\n".join(thinking)}, []
        if kind == "message":
            turn.add({**_message_of(item, param), **past}, Source("message", param))
        elif kind == "function_call":
            function = {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            }
            call = {"id": _string(item, "call_id", param), "type": "function", "function": function}
            last = turn.sources[-1] if turn.sources else None
            if last is not None and last.kind == "function_call":
                turn.messages[-1]["tool_calls"].append(call)
                last.calls.append(param)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call], **past}
                turn.add(message, Source("function_call", param, [param]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            call_id = _string(item, "call_id", param)
            message = {"role": "tool", "tool_call_id": call_id, "content": text}
            turn.add(message, Source("function_call_output", param))
        elif kind == "reasoning":
            # Past thinking: the next assistant turn's reasoning_content, which templates
            # that render past reasoning read (`tools.template_input`).
            thinking.append(_reasoning_text(item, param))
        else:
            raise refuse(f"{param}.type", f"items of type {kind!r} are not supported")
    return turn


# The custom tools' items by the function items they are read as.
_CUSTOM_KINDS = {
    "custom_tool_call": "function_call",
    "custom_tool_call_output": "function_call_output",
}


def _as_function_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A ``custom_tool_call`` item as a ``function_call`` item (its ``input`` as the
    arguments the model wrote: `responses.custom.call_arguments`); an output as is."""
    if item.get("type") == "custom_tool_call_output":
        return {**item, "type": "function_call_output"}
    text = _string(item, "input", param)
    if text is None:
        raise refuse(f"{param}.input", "this field is required")
    return {**item, "type": "function_call", "arguments": call_arguments(text)}


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary's text."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            texts = []
            for index, part in enumerate(parts):
                if not isinstance(part, dict) or part.get("type") != part_type:
                    raise refuse(f"{param}.{key}.{index}", f"expected a {part_type} part")
                texts.append(_string(part, "text", f"{param}.{key}.{index}") or "")
            return "\n".join(texts)
    return ""


def _message_of(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        expected = ", ".join(repr(r) for r in ROLES[:-1]) + f" or {ROLES[-1]!r}"
        given = "this field is required" if "role" not in item else f"got {_shown(role)}"
        raise refuse(f"{param}.role", f"expected {expected}; {given}")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise refuse(f"{param}.content.{index}", "only text parts are supported")
            texts.append(_string(part, "text", f"{param}.content.{index}") or "")
        content = "\n".join(texts)
    return {"role": role, "content": content}


def chat_tools(body: ResponsesRequest) -> dict[str, Any]:
    """The Responses' flat function tools and tool choice in chat's shape."""
    fields: dict[str, Any] = {}
    if body.tools is not None:
        tools = []
        for index, tool in enumerate(body.tools):
            kind = tool.get("type")
            if kind == "custom":
                function = custom_function(tool, index)
            elif kind == "function":
                function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            else:
                supported = '"function" and "custom" tools are supported'
                raise refuse(
                    f"tools.{index}.type", f"{kind!r} tools are not supported ({supported})"
                )
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


class FieldNames:
    """Chat's names for the fields of one Responses request mapped back to the request's:
    ``messages.N…`` to the item message N came from (`Source`), a flat tool's and a named
    tool choice's fields without chat's ``function``, ``text.format`` for
    ``response_format`` (without its ``json_schema``), ``max_output_tokens`` for
    ``max_tokens``."""

    def __init__(self, body: ResponsesRequest, stored: int, turn: InputMessages) -> None:
        """``stored``: the messages of the stored conversation before ``turn``'s."""
        system = [Source("instructions", "instructions")] if body.instructions else []
        history = [Source("stored", "previous_response_id") for _ in range(stored)]
        self.sources = system + history + turn.sources
        self.custom = {i for i, tool in enumerate(body.tools or []) if tool.get("type") == "custom"}

    def name(self, param: str) -> str:
        """The request's name for chat's field ``param``."""
        head, _, rest = param.partition(".")
        if head == "messages":
            place, _, rest = rest.partition(".")
            if place.isdigit() and int(place) < len(self.sources):
                return self.sources[int(place)].name(rest)
            return "input"
        if head == "tools":
            place = rest.partition(".")[0]
            if place.isdigit() and int(place) in self.custom:  # its schema is its format's
                custom = re.sub(r"^(tools\.\d+)\.function\.parameters(\.|$).*", r"\1.format", param)
                if custom != param:
                    return custom + ".definition"
            return re.sub(r"^(tools\.\d+)\.function(?=\.|$)", r"\1", param)
        if head == "tool_choice":
            return re.sub(r"^tool_choice\.function(?=\.|$)", "tool_choice", param)
        if head == "response_format":
            return _joined("text.format", re.sub(r"^json_schema(\.|$)", "", rest))
        return _joined("max_output_tokens" if head == "max_tokens" else head, rest)

    def renamed(self, exc: APIError) -> APIError:
        """``exc`` naming the request's field where it names chat's."""
        param = exc.param
        if param is None or self.name(param) == param:
            return exc
        renamed = self.name(param)
        message = exc.message.replace(param, renamed, 1)
        return APIError(exc.status, message, exc.kind, renamed, exc.code, exc.headers)


def chat_request(
    body: ResponsesRequest, messages: list[dict[str, Any]], names: FieldNames
) -> ChatCompletionRequest:
    """The chat completion ``body`` asks for (``messages``: the stored conversation, then
    the input's, without the instructions); a field chat refuses is a 400 naming it."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {
        "model": body.model,
        "messages": system + messages,
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
        raise names.renamed(error) from None
