"""A chat reply read for its structure, whole or as it streams: its thinking section
(`reasoning`) and its tool calls (`tool_formats.scan`), the parts OpenAI's chat, the
Responses API and Anthropic's Messages each answer in their own shape.

`ReplyShape` says what to look for (a call syntax, a thinking section, the special tokens
whose text goes back into the reply: the engine's text leaves special tokens out).
`ReplyStream` turns one choice's text, pushed token by token, into deltas: ``reasoning``
text, ``content`` text, and ``tool_calls`` (a call's index, id, type and name first, then
its argument fragments, as OpenAI streams them). `read_reply` reads a whole reply into a
`Reply`. The reasoning is split off first; only the content after it is read for calls.

A reply's calls are read with `tool_formats.scan`: whole for a JSON answer; for a stream,
all of its content again at each token (a reply is short next to a scan's cost), and what
is new since the last delta is sent.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine import TokenEvent
from slotserve.server.chat.reasoning import Reasoning, ReasoningSplitter
from slotserve.server.chat.tool_formats import MISTRAL, CallSyntax, Scan, scan


@dataclass(frozen=True)
class ReplyShape:
    """What a reply is read for: ``syntax`` (its tools' call syntax; None: no tools),
    ``reasoning`` (None: no thinking section) and ``markers`` (special tokens written
    back into its text: id → text)."""

    syntax: CallSyntax | None = None
    reasoning: Reasoning | None = None
    markers: dict[int, str] = field(default_factory=dict)

    def text(self, event: TokenEvent) -> str:
        """One token's text, with a special token of the syntax written back."""
        return event.text + self.markers.get(event.token_id, "")


def call_id(syntax: CallSyntax) -> str:
    """A new call id; Mistral's templates take nine letters and digits only."""
    return uuid.uuid4().hex[:9] if syntax is MISTRAL else f"call_{uuid.uuid4().hex[:24]}"


def parse_reply(syntax: CallSyntax, text: str) -> tuple[str, list[tuple[str, str]], bool]:
    """A whole reply's content, its calls ((name, arguments JSON) pairs) and whether the
    last call was cut short (the token budget ran out inside it: its arguments are the JSON
    written so far). What it reads is what `CallStream` streams from the same text: the
    content before the calls, every call whose name is whole. Text that breaks the syntax
    (only possible where no grammar wrote it) is all content, with no calls."""
    found = scan(syntax, text, final=True)
    if found.broken:
        return text, [], False
    named = [call for call in found.calls if call.name is not None]
    cut = any(not call.complete for call in named)
    return found.content, [(str(call.name), call.arguments) for call in named], cut


class CallStream:
    """One choice's content as it streams: `push` its text, get the deltas that are new
    (content, a call's announcement with its id and name, its argument fragments)."""

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.text = ""
        self._content = 0  # characters of content sent
        self._arguments: list[int] = []  # characters of each announced call's arguments sent

    @property
    def called(self) -> bool:
        return bool(self._arguments)

    def push(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        self.text += text
        return self._deltas(scan(self.syntax, self.text, final=final))

    def _deltas(self, found: Scan) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if len(found.content) > self._content:
            deltas.append({"content": found.content[self._content :]})
            self._content = len(found.content)
        for index, call in enumerate(found.calls):
            if call.name is None:
                break
            if index == len(self._arguments):
                function = {"name": call.name, "arguments": ""}
                announce = {"index": index, "id": call_id(self.syntax), "type": "function"}
                deltas.append({"tool_calls": [{**announce, "function": function}]})
                self._arguments.append(0)
            sent = self._arguments[index]
            if len(call.arguments) > sent:
                fragment = {"index": index, "function": {"arguments": call.arguments[sent:]}}
                deltas.append({"tool_calls": [fragment]})
                self._arguments[index] = len(call.arguments)
        return deltas


class ReplyStream:
    """One choice's reply as it streams: `push` each token's text (`ReplyShape.text`),
    get its new deltas: ``{"reasoning": …}``, ``{"content": …}``, ``{"tool_calls": […]}``.
    ``reasoning_tokens`` counts the tokens of the thinking section, its tags included."""

    def __init__(self, shape: ReplyShape) -> None:
        reasoning = shape.reasoning
        self.splitter = ReasoningSplitter(reasoning.starts_open) if reasoning else None
        self.calls = CallStream(shape.syntax) if shape.syntax is not None else None
        self.reasoning_tokens = 0

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def push(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        if self.splitter is None:
            parts = [("content", text)]
        else:
            before = self.splitter.phase
            parts = list(self.splitter.push(text, final=final))
            if text and "reasoning" in (before, self.splitter.phase):
                self.reasoning_tokens += 1
        deltas: list[dict[str, Any]] = []
        for kind, piece in parts:
            if kind == "reasoning":
                deltas.append({"reasoning": piece})
            elif self.calls is not None:
                deltas += self.calls.push(piece)
            elif piece:
                deltas.append({"content": piece})
        if final and self.calls is not None:
            deltas += self.calls.push("", final=True)
        return deltas


@dataclass(frozen=True)
class Reply:
    """A whole reply: its reasoning (None: no thinking section), content, calls ((name,
    arguments JSON) pairs), how many of its tokens were reasoning, and whether its last
    call was cut short by the token budget (``cut``: its arguments are a JSON prefix)."""

    reasoning: str | None
    content: str
    calls: list[tuple[str, str]]
    reasoning_tokens: int = 0
    cut: bool = False


def read_reply(shape: ReplyShape, events: Sequence[TokenEvent]) -> Reply:
    """A whole reply from its token events."""
    texts = [shape.text(event) for event in events]
    reasoning_tokens = 0
    if shape.reasoning is None:
        content = "".join(texts)
        reasoning: str | None = None
    else:
        splitter = ReasoningSplitter(shape.reasoning.starts_open)
        parts = []
        for text in texts:
            before = splitter.phase
            parts += splitter.push(text)
            if text and "reasoning" in (before, splitter.phase):
                reasoning_tokens += 1
        parts += splitter.push("", final=True)
        reasoning = "".join(t for kind, t in parts if kind == "reasoning") or None
        content = "".join(t for kind, t in parts if kind == "content")
    if shape.syntax is None:
        return Reply(reasoning, content, [], reasoning_tokens)
    content, calls, cut = parse_reply(shape.syntax, content)
    return Reply(reasoning, content, calls, reasoning_tokens, cut)
