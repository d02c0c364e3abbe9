"""Tool calling, the reply's side: a chat completion decoded under its `ToolPlan`'s grammar,
answered as OpenAI does: ``message.tool_calls`` and ``finish_reason: "tool_calls"``, or
streamed as ``delta.tool_calls`` chunks (each call's index, id, type and name first, then
its arguments as they are written).

A reply's text is read with `tool_formats.scan`: whole for a JSON answer; for a stream,
all of it again at each token (a reply is short next to a scan's cost), and what is new
since the last chunk is sent. Special tokens the syntax writes (``[TOOL_CALLS]``) are put
back into the text, which the engine leaves them out of.
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
from slotserve.server import responses as fmt
from slotserve.server.completions import (
    check_finish,
    priority_of,
    prompt_tokens,
    sampling_params,
)
from slotserve.server.errors import APIError, error_body
from slotserve.server.generation import Outcome, collect, merged, submit_all
from slotserve.server.schemas import ChatCompletionRequest
from slotserve.server.state import ServerState
from slotserve.server.structured import logit_bias
from slotserve.server.tool_formats import MISTRAL, CallSyntax, Scan, scan
from slotserve.server.tools import ToolPlan, tool_grammar


async def generate_with_tools(
    state: ServerState,
    engine: Engine,
    body: ChatCompletionRequest,
    request: Request,
    prompt: list[int],
    plan: ToolPlan,
) -> Response:
    """Run a chat ``prompt`` whose reply may call ``plan``'s tools: a JSON answer or an
    SSE stream (`completions.generate`'s, with tool calls)."""
    n = body.n or 1
    if n > engine.config.max_seqs:
        message = f"n={n} exceeds this server's max_seqs={engine.config.max_seqs}"
        raise APIError(400, message, "invalid_request_error", param="n")
    tokens = prompt_tokens(engine, prompt, "messages")
    tokenizer = engine.model.tokenizer
    grammar = await tool_grammar(state.grammars_of(engine), plan, tokenizer)
    room = engine.config.max_context - len(tokens)
    bias = logit_bias(engine, body)
    params = [sampling_params(body, room, i, state.sampling, grammar, bias) for i in range(n)]
    handles = submit_all(
        engine, tokens, params, priority_of(body, request), "messages", keep_conversation=True
    )
    markers = {token: text for text, token in plan.specials(tokenizer).items()}
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = fmt.envelope("chat.completion", request_id, created, state.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        stream = _stream(engine, handles, plan.syntax, markers, head, body, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    outcomes = await collect(handles, request)
    return JSONResponse(_complete(engine, outcomes, plan.syntax, markers, head, body))


def call_id(syntax: CallSyntax) -> str:
    """A new call id; Mistral's templates take nine letters and digits only."""
    return uuid.uuid4().hex[:9] if syntax is MISTRAL else f"call_{uuid.uuid4().hex[:24]}"


def reply_text(events: list[TokenEvent], markers: dict[int, str]) -> str:
    """The text of a reply's events, with the syntax's special tokens written back."""
    return "".join(event.text + markers.get(event.token_id, "") for event in events)


def _finish_reason(final: Finished, called: bool) -> str:
    return "tool_calls" if called and final.reason == "stop" else fmt.FINISH_REASONS[final.reason]


def parse_reply(syntax: CallSyntax, text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole reply's content and calls ((name, arguments JSON) pairs): its calls when all
    of them are whole, else none and its text as content (a reply cut short by the token
    budget, or one the grammar did not write)."""
    found = scan(syntax, text, final=True)
    whole = found.calls and not found.broken and all(call.complete for call in found.calls)
    if not whole:
        return (text if found.broken or found.calls else found.content), []
    return found.content, [(str(call.name), call.arguments) for call in found.calls]


def _message(syntax: CallSyntax, text: str) -> dict[str, Any]:
    """The assistant message of a whole reply (`parse_reply`)."""
    content, calls = parse_reply(syntax, text)
    if not calls:
        return {"role": "assistant", "content": content, "refusal": None}
    tool_calls = [
        {"id": call_id(syntax), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in calls
    ]
    return {
        "role": "assistant",
        "content": content or None,
        "refusal": None,
        "tool_calls": tool_calls,
    }


def _complete(
    engine: Engine,
    outcomes: list[Outcome],
    syntax: CallSyntax,
    markers: dict[int, str],
    head: dict[str, Any],
    body: ChatCompletionRequest,
) -> dict[str, Any]:
    finals: list[Finished] = []
    choices = []
    wants_logprobs = body.logprobs_count() is not None
    for index, outcome in enumerate(outcomes):
        final = outcome.final
        assert final is not None  # collect waits for every choice's end
        check_finish(final)
        finals.append(final)
        message = _message(syntax, reply_text(outcome.events, markers))
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
    return {**head, "choices": choices, "usage": fmt.usage(finals)}


class CallStream:
    """One choice's reply as it streams: `push` its text, get the deltas that are new
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


async def _stream(
    engine: Engine,
    handles: list[Any],
    syntax: CallSyntax,
    markers: dict[int, str],
    head: dict[str, Any],
    body: ChatCompletionRequest,
    include_usage: bool,
) -> AsyncIterator[str]:
    tokenizer = engine.model.tokenizer
    wants_logprobs = body.logprobs_count() is not None
    replies = [CallStream(syntax) for _ in handles]
    finals: list[Finished] = []

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return fmt.sse({**head, "choices": [choice]})

    for index in range(len(handles)):
        yield chunk(index, {"role": "assistant", "content": ""}, None, None)
    # aclosing: the handles are cancelled as soon as the stream stops, even on an error.
    async with aclosing(merged(handles)) as events:
        try:
            async for index, event in events:
                reply = replies[index]
                if isinstance(event, Finished):
                    check_finish(event)  # a cut-short stream ends with an error event instead
                    finals.append(event)
                    for delta in reply.push("", final=True):
                        yield chunk(index, delta, None, None)
                    yield chunk(index, {}, _finish_reason(event, reply.called), None)
                    continue
                logprobs = (
                    fmt.chat_logprobs(tokenizer, [event])
                    if wants_logprobs and event.token_id >= 0
                    else None
                )
                deltas = reply.push(event.text + markers.get(event.token_id, ""))
                if not deltas and logprobs is not None:
                    deltas = [{}]  # a token held back still reports its logprobs
                for delta in deltas:
                    yield chunk(index, delta, None, logprobs)
                    logprobs = None  # a token's logprobs ride on its first chunk
        except APIError as exc:
            yield fmt.sse(error_body(exc.message, exc.kind, exc.param, exc.code))
    if include_usage:
        yield fmt.sse({**head, "choices": [], "usage": fmt.usage(finals)})
    yield fmt.sse("[DONE]")
