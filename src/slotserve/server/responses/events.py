"""The Responses API's output items (a reasoning item, a message, function calls) and its
stream of events: each item opened (``response.output_item.added``), its text or arguments
in deltas (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), then closed (``….done``,
``response.output_item.done``), every event numbered in order (``sequence_number``).
Shapes only: what the reply holds is `chat.reply`'s to read."""

from __future__ import annotations

import uuid
from typing import Any

from slotserve.server.openai import replies as fmt
from slotserve.server.responses.custom import call_arguments, custom_item, input_of


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)] if status == "completed" else [],
    }


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A thinking section (`reasoning`): its text as ``reasoning_text`` content; no summary
    (the model writes none)."""
    return {
        "id": f"rs_{uuid.uuid4().hex}",
        "type": "reasoning",
        "summary": [],
        "content": [reasoning_part(text)] if status == "completed" else [],
        "status": status,
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


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's output items as the chat messages the next turn renders (its reasoning as
    the turn's ``reasoning_content``, which templates that render past reasoning read)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {
                "name": item["name"],
                "arguments": call_arguments(item["input"])
                if item["type"] == "custom_tool_call"
                else item["arguments"],
            },
        }
        for item in output
        if item["type"] in ("function_call", "custom_tool_call")
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = [
        part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]
    ]
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


# Per kind of item with text: the delta and done events, the part and its builder.
_TEXT_EVENTS = {
    "message": ("response.output_text.delta", "response.output_text.done"),
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
}


class EventWriter:
    """The stream's events in order, numbered, with the output items they open and close.
    `deltas` takes `chat.reply.ReplyStream`'s deltas; a call of one of the ``custom`` tools
    is a ``custom_tool_call`` item, its input streamed as it decodes from the arguments
    (`responses.custom.input_of`)."""

    def __init__(self, custom: frozenset[str] = frozenset()) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.custom = custom
        self._arguments = ""  # the open custom call's arguments so far

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
            if delta.get("reasoning"):
                lines += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                lines += self._text("message", delta["content"])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    lines += self.close_item()
                    name = call["function"]["name"]
                    if name in self.custom:
                        self._arguments = ""
                        lines += self._open(custom_item(name, ""))
                    else:
                        lines += self._open(function_item(name, "", "in_progress"))
                fragment = call["function"].get("arguments", "")
                if fragment:
                    lines += self._arguments_delta(fragment)
        return lines

    def _arguments_delta(self, fragment: str) -> list[str]:
        item = self.open
        assert item is not None
        if item["type"] != "custom_tool_call":
            item["arguments"] += fragment
            return [self._at("response.function_call_arguments.delta", delta=fragment)]
        self._arguments += fragment
        text = input_of(self._arguments)
        new = text[len(item["input"]) :]
        item["input"] = text
        return [self._at("response.custom_tool_call_input.delta", delta=new)] if new else []

    def _text(self, kind: str, text: str) -> list[str]:
        """``text`` into the open item of ``kind`` (a message, or reasoning), opened here
        (with its content part) when another kind is open."""
        lines: list[str] = []
        if self.open is None or self.open["type"] != kind:
            lines += self.close_item()
            empty = message_item("", "in_progress") if kind == "message" else None
            lines += self._open(empty or reasoning_item("", "in_progress"))
            part = text_part("") if kind == "message" else reasoning_part("")
            lines.append(self._at("response.content_part.added", part=part))
        assert self.open is not None
        self.open["text"] = self.open.get("text", "") + text
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        lines.append(self._at(_TEXT_EVENTS[kind][0], delta=text, **extra))
        return lines

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        return [self.send("response.output_item.added", output_index=self.index, item=item)]

    def _at(self, kind: str, **fields: Any) -> str:
        assert self.open is not None
        place = {"item_id": self.open["id"], "output_index": self.items.index(self.open)}
        if self.open["type"] in _TEXT_EVENTS:
            place["content_index"] = 0
        return self.send(kind, **place, **fields)

    def close_item(self, whole: bool = True) -> list[str]:
        """Close the open item (``whole``: completed, else incomplete: the budget ran out)."""
        item = self.open
        if item is None:
            return []
        lines: list[str] = []
        if item["type"] in _TEXT_EVENTS:
            text = item.pop("text", "")
            part = text_part(text) if item["type"] == "message" else reasoning_part(text)
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            lines.append(self._at(_TEXT_EVENTS[item["type"]][1], text=text, **extra))
            lines.append(self._at("response.content_part.done", part=part))
            item["content"] = [part]
        elif item["type"] == "custom_tool_call":
            lines.append(self._at("response.custom_tool_call_input.done", input=item["input"]))
        else:
            lines.append(
                self._at(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        self.open = None
        if item["type"] != "custom_tool_call":  # a custom call has no status
            item["status"] = "completed" if whole else "incomplete"
        lines.append(
            self.send("response.output_item.done", output_index=self.items.index(item), item=item)
        )
        return lines
