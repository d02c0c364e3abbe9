"""The reply side of ``/v1/messages``: one message as Anthropic's Messages API answers it,
whole or streamed. Its content blocks are a ``thinking`` block for a thinking model's
section (`reasoning`; its ``signature`` is empty: nothing here signs it), ``text``, and
``tool_use`` blocks, read from the reply by `chat.reply`; its ``stop_reason`` is
``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``. The stream is the API's
events: ``message_start``, per block ``content_block_start``/``delta``/``stop``
(``thinking_delta``, ``text_delta``, ``input_json_delta``), ``message_delta`` and
``message_stop``; an error mid-stream is an ``error`` event."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

import pydantic_core

from slotserve.engine import Engine, Finished, TokenEvent
from slotserve.server.chat.reply import ReplyStream, read_reply
from slotserve.server.chat.run import ChatRun
from slotserve.server.http.errors import APIError
from slotserve.server.http.generation import merged
from slotserve.server.http.state import ServerState
from slotserve.server.openai.replies import sse_json

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


class Stops(Protocol):
    """What the reply needs of the request: its stop sequences."""

    stop_sequences: list[str] | None


def tool_use(name: str, arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block. A call the token budget cut short has a JSON prefix for its
    arguments: its input is what that prefix holds (a member whose value is not whole left
    out), as Anthropic's clients read a streamed ``partial_json``."""
    parsed = pydantic_core.from_json(arguments, allow_partial=True) if arguments else {}
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": parsed if isinstance(parsed, dict) else {},
    }


def thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {sse_json({'type': kind, **fields})}\n\n"


class MessageReply:
    """One message as it is made."""

    def __init__(self, state: ServerState, engine: Engine, body: Stops, run: ChatRun) -> None:
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

    def whole(self, events: list[TokenEvent], final: Finished) -> dict[str, Any]:
        reply = read_reply(self.run.shape, events)
        blocks: list[dict[str, Any]] = []
        if reply.reasoning is not None:
            blocks.append(thinking(reply.reasoning))
        if reply.content or not reply.calls:
            blocks.append({"type": "text", "text": reply.content})
        blocks += [tool_use(name, arguments) for name, arguments in reply.calls]
        return self.message(blocks, final)

    async def stream(self) -> AsyncIterator[str]:
        yield event("message_start", message=self.message([], None))
        blocks = _Blocks()
        reply = ReplyStream(self.run.shape)
        async with aclosing(merged(self.run.handles)) as events:
            try:
                async for _, item in events:
                    if isinstance(item, Finished):
                        self.run.check(item)
                        deltas = reply.push("", final=True)
                    else:
                        deltas = reply.push(self.run.shape.text(item))
                    for delta in deltas:
                        for line in blocks.delta(delta):
                            yield line
                    if isinstance(item, Finished):
                        for line in blocks.close():
                            yield line
                        stop_reason, stop_sequence = self.stop(item, blocks.blocks)
                        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                        usage = {"output_tokens": item.usage.completion_tokens}
                        yield event("message_delta", delta=delta, usage=usage)
                        yield event("message_stop")
            except APIError as exc:
                status = 529 if exc.status == 503 else exc.status
                error = {"type": ERROR_TYPES.get(status, "api_error"), "message": exc.message}
                yield event("error", error=error)


class _Blocks:
    """The content blocks of a streamed message, each opened, filled and closed."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open_kind: str | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        lines = self.close()
        self.blocks.append(block)
        self.open_kind = kind
        return [*lines, event("content_block_start", index=self.index, content_block=block)]

    @property
    def index(self) -> int:
        return len(self.blocks) - 1

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", index=self.index)]

    def delta(self, delta: dict[str, Any]) -> list[str]:
        lines: list[str] = []
        for kind, key, delta_type in (
            ("reasoning", "thinking", "thinking_delta"),
            ("content", "text", "text_delta"),
        ):
            piece = delta.get(kind)
            if not piece:
                continue
            if self.open_kind != kind:
                empty = thinking("") if kind == "reasoning" else {"type": "text", "text": ""}
                lines += self._open(kind, empty)
            self.blocks[-1][key] += piece
            body = {"type": delta_type, key: piece}
            lines.append(event("content_block_delta", index=self.index, delta=body))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                block = tool_use(call["function"]["name"], "{}")
                lines += self._open("tool_use", {**block, "input": {}})
            fragment = call["function"].get("arguments", "")
            if fragment:
                body = {"type": "input_json_delta", "partial_json": fragment}
                lines.append(event("content_block_delta", index=self.index, delta=body))
        return lines
