"""Tool calls from the real bundled model (SmolLM2-135M-Instruct) with the official openai
client (strict): under ``tool_choice: "required"`` and a named function, whole and streamed,
every call's arguments parse as JSON and validate against their function's schema
(jsonschema), for realistic on-device tools: bounded integers, enums, required strings, a
nested object and an array. The model is small and knows none of these tools, so what keeps
its calls valid is the grammar, which is what this checks. Sampling is seeded (temperature 1)
so each case is reproducible: the grammar bounds what a call may hold, not how long a free
string runs, and now and then the model rambles in one past the budget (``finish_reason:
"length"``, no call): 1 of 8 seeds of the timer's label at 256 tokens. So a sampled case
takes its seeds in turn until a call completes (`sampled_calls`), and fails if none of four
does; a completed call must validate."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess

MAX_TOKENS = 256
TIMER = {
    "type": "object",
    "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 120},
        "label": {"type": "string"},
    },
    "required": ["minutes", "label"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "when": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["day", "hour"],
            "additionalProperties": False,
        },
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "when"],
    "additionalProperties": False,
}
NOTES = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1},
        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["work", "home"]}, "maxItems": 2},
    },
    "required": ["query"],
    "additionalProperties": False,
}
FUNCTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "set_timer": ("Start a countdown timer", TIMER),
    "get_weather": ("Current weather in a city", WEATHER),
    "create_event": ("Add an event to the calendar", EVENT),
    "search_notes": ("Search the user's notes", NOTES),
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
    for n, (d, p) in FUNCTIONS.items()
]
ASKS = {
    "set_timer": "Set a timer for 10 minutes for the pasta.",
    "get_weather": "What is the weather in Lyon, in celsius?",
    "create_event": "Book lunch with Ana on Tuesday at noon.",
    "search_notes": "Find my notes about the garden.",
}


def assert_valid(name: str, arguments: str) -> dict[str, Any]:
    """The call's arguments, which must be JSON valid under its function's schema."""
    value = json.loads(arguments)
    jsonschema.validate(value, FUNCTIONS[name][1])
    assert isinstance(value, dict)
    return value


def ask(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, name: str, choice: Any, **kw: Any
) -> Any:
    return bundled_client.chat.completions.create(
        model=bundled_server.model_name,
        messages=[{"role": "user", "content": ASKS[name]}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=MAX_TOKENS,
        **kw,
    )


def whole_calls(answer: Any) -> list[tuple[str, str]]:
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert calls and all(call.type == "function" for call in calls)
    return [(call.function.name, call.function.arguments) for call in calls]


def streamed_calls(chunks: list[Any]) -> list[tuple[str, str]]:
    """The calls a stream puts together: index, id and name first, then argument fragments."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls) and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def sampled_calls(
    bundled_client: openai.OpenAI,
    bundled_server: ServerProcess,
    name: str,
    choice: Any,
    seeds: tuple[int, ...],
    stream: bool,
    **fields: Any,
) -> list[tuple[str, str]]:
    """The calls of the first of ``seeds`` (temperature 1) whose answer is not cut short at
    MAX_TOKENS: a ramble in a free string past the budget is the model's, not the grammar's
    (the kernels' rounding decides which seeds ramble)."""
    for seed in seeds:
        if stream:
            chunks = list(
                ask(bundled_client, bundled_server, name, choice, stream=True, seed=seed, **fields)
            )
            if any(c.finish_reason == "length" for chunk in chunks for c in chunk.choices):
                continue
            return streamed_calls(chunks)
        answer = ask(bundled_client, bundled_server, name, choice, seed=seed, **fields)
        if answer.choices[0].finish_reason != "length":
            return whole_calls(answer)
    pytest.fail(f"{name}: every seed of {seeds} ran past {MAX_TOKENS} tokens")


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_calls_validate(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, name: str, stream: bool
) -> None:
    calls = sampled_calls(
        bundled_client, bundled_server, name, named(name), (3, 4, 5, 6), stream, temperature=1.0
    )
    assert {n for n, _ in calls} == {name}
    for called, arguments in calls:
        assert_valid(called, arguments)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_validate(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, name: str, stream: bool
) -> None:
    """Any of the tools may be called; each call validates against the one it names."""
    calls = sampled_calls(
        bundled_client,
        bundled_server,
        name,
        "required",
        (7, 8, 9, 10),
        stream,
        parallel_tool_calls=False,
        temperature=1.0,
    )
    assert len(calls) == 1
    for called, arguments in calls:
        assert called in FUNCTIONS
        assert_valid(called, arguments)


def test_greedy_streamed_equals_whole(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess
) -> None:
    """Greedy, the streamed call is the whole one, fragment by fragment."""
    fields: dict[str, Any] = {"temperature": 0, "parallel_tool_calls": False}
    whole = whole_calls(ask(bundled_client, bundled_server, "create_event", "required", **fields))
    chunks = list(
        ask(bundled_client, bundled_server, "create_event", "required", stream=True, **fields)
    )
    assert streamed_calls(chunks) == whole
    for called, arguments in whole:
        assert_valid(called, arguments)


@pytest.mark.parametrize(
    "name,arguments",
    [
        ("set_timer", '{"minutes": 0, "label": "pasta"}'),  # under the minimum
        ("set_timer", '{"minutes": 10.5, "label": "pasta"}'),  # not an integer
        ("get_weather", '{"city": "Lyon", "unit": "kelvin"}'),  # not in the enum
        ("create_event", '{"title": "lunch", "when": {"day": "tuesday"}}'),  # no hour
        ("search_notes", '{"query": "garden", "extra": 1}'),  # not a property
        ("search_notes", '{"query": "garden"'),  # not JSON
    ],
)
def test_the_check_catches_bad_arguments(name: str, arguments: str) -> None:
    """Control: the validation this module relies on refuses what the schemas exclude."""
    with pytest.raises((jsonschema.ValidationError, json.JSONDecodeError)):
        assert_valid(name, arguments)
