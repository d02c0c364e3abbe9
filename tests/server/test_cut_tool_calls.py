"""A tool call cut short by the token budget is a tool call in every API, whole or streamed,
never call syntax in the text: the bundled model (SmolLM2-135M-Instruct) under
``tool_choice: "required"``, greedy, with budgets that end inside the call's name, its
arguments' keys and its string argument. The whole reply carries what the stream
delivers: the call (its name, its arguments written so far) with ``finish_reason:
"length"`` (chat), a ``function_call`` item ``incomplete`` (Responses), a ``tool_use``
block holding what the partial arguments hold (Anthropic).

`parse_reply` is also checked on its own against `CallStream`, on every prefix of a
reply: what the stream sends is what the whole reply reads."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from slotserve.server.chat.reply import CallStream, parse_reply
from slotserve.server.chat.tool_formats import GENERIC, HERMES, LLAMA3, MISTRAL, CallSyntax
from tests.server.conftest import ServerProcess

TIMER = {
    "type": "object",
    "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
    "required": ["minutes", "label"],
}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "set_timer", "parameters": TIMER}}]
ASK: list[Any] = [{"role": "user", "content": "Set a timer for 9 minutes"}]
# Budgets that end the reply inside the call's head, its name, its arguments' keys and
# its string argument (the bundled model, greedy, for ASK).
BUDGETS = (12, 14, 18, 24, 27)


def _chat(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, budget: int, **fields: Any
) -> Any:
    return bundled_client.chat.completions.create(
        model=bundled_server.model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=budget,
        **fields,
    )


@pytest.mark.parametrize("budget", BUDGETS)
def test_chat_cut_call_is_the_streamed_call(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, budget: int
) -> None:
    whole = _chat(bundled_client, bundled_server, budget).choices[0]
    assert whole.finish_reason == "length"
    assert not whole.message.content  # no call syntax, ever
    whole_calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    content, calls, finish = "", {}, None
    for chunk in _chat(bundled_client, bundled_server, budget, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "length" and content == ""
    assert whole_calls == [tuple(calls[i]) for i in sorted(calls)]
    if budget >= 24:  # past the name and into the arguments: a call with a JSON prefix
        ((name, arguments),) = whole_calls
        assert name == "set_timer" and arguments.startswith('{"minutes": ')


def test_responses_cut_call(bundled_client: openai.OpenAI, bundled_server: ServerProcess) -> None:
    tools: list[Any] = [{"type": "function", "name": "set_timer", "parameters": TIMER}]
    ask: dict[str, Any] = {
        "model": bundled_server.model_name,
        "input": ASK[0]["content"],
        "tools": tools,
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 27,
    }
    response = bundled_client.responses.create(**ask)
    assert response.status == "incomplete"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.name == "set_timer" and item.arguments.startswith('{"minutes": ')
    streamed = None
    for event in bundled_client.responses.create(**ask, stream=True):
        if event.type == "response.incomplete":
            streamed = event.response
    assert streamed is not None
    (streamed_item,) = streamed.output
    assert streamed_item.type == "function_call" and streamed_item.status == "incomplete"
    assert (streamed_item.name, streamed_item.arguments) == (item.name, item.arguments)


def test_anthropic_cut_call(bundled_server: ServerProcess) -> None:
    anthropic = pytest.importorskip("anthropic")
    ask: dict[str, Any] = {
        "model": bundled_server.model_name,
        "max_tokens": 27,
        "messages": ASK,
        "tools": [{"name": "set_timer", "input_schema": TIMER}],
        "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(
        base_url=bundled_server.url,
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        message = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
    assert message.stop_reason == final.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "set_timer"
    assert block.input.get("minutes") == 9  # what the partial arguments hold
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.input == block.input


def _streamed(syntax: CallSyntax, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream sends for ``text``, a character at a time."""
    stream = CallStream(syntax)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.push("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"].get("arguments", "")
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL, LLAMA3, GENERIC], ids=lambda s: s.name)
def test_every_prefix_reads_as_it_streams(syntax: CallSyntax) -> None:
    before = "" if syntax in (GENERIC, LLAMA3) else "Sure. "
    calls = [("set_timer", '{"minutes": 9, "label": "pasta {x}"}')]
    if syntax.max_calls is None:
        calls.append(("get_weather", '{"city": "Lyon"}'))
    reply = before + syntax.calls_text(calls)
    for end in range(len(reply) + 1):
        text = reply[:end]
        content, read, cut = parse_reply(syntax, text)
        assert (content, read) == _streamed(syntax, text), text
        assert syntax.trigger not in content, text  # no call syntax in the text
        for _, arguments in read if not cut else read[:-1]:
            json.loads(arguments)  # only the last call can be cut
        if end == len(reply):
            assert read == calls and not cut
