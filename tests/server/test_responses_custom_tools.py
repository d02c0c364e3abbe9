"""The Responses API's custom tools and its fields, through the official ``openai`` client
(strict response validation) and the ``anthropic`` client against a real server on the
bundled model (SmolLM2-135M-Instruct), greedy:

- a custom tool with a regular-expression format is called with an input the expression
  matches whole, as a ``custom_tool_call`` item; the stream (``custom_tool_call_input``
  deltas) delivers the same input, also when the token budget cuts the call short;
- the call and its output sent back as input items (or through ``previous_response_id``)
  continue the conversation;
- a custom tool with a Lark grammar (quotes and line breaks in its language, so its input
  is escaped inside the call) is called with an input the grammar parses, whole or
  streamed alike;
- a regular expression llguidance refuses, a Lark grammar it refuses and one the rewrite
  cannot carry over (``%ignore``, ``%import``, lexeme options, flags) are a 400 naming
  ``tools.0.format.definition``;
- fields no API defines are reported in ``X-Slotserve-Ignored-Fields`` (Responses, Messages,
  count_tokens), OpenAI's and Anthropic's fields not implemented are a 400 naming them,
  and their hints are accepted without a report.
"""

from __future__ import annotations

import re
from typing import Any

import anthropic
import openai
import pytest

from tests.server.conftest import ServerProcess

REGEX = r"[0-9]{1,2} minutes( [a-z]+)?"
TOOLS: list[Any] = [
    {
        "type": "custom",
        "name": "set_timer",
        "description": "Set a timer",
        "format": {"type": "grammar", "syntax": "regex", "definition": REGEX},
    }
]
ASK = "Set a timer for 9 minutes"


def _ask(bundled_client: openai.OpenAI, bundled_server: ServerProcess, **fields: Any) -> Any:
    fields = {"tools": TOOLS, "tool_choice": "required", "max_output_tokens": 60, **fields}
    return bundled_client.responses.create(
        model=bundled_server.model_name, input=ASK, temperature=0, **fields
    )


def _streamed(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, budget: int
) -> tuple[str, Any]:
    """The input the stream's deltas spell, and the response its last event carries
    (``response.completed``, or ``response.incomplete`` when the budget ran out)."""
    deltas, final = "", None
    for event in bundled_client.responses.create(
        model=bundled_server.model_name,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_output_tokens=budget,
        stream=True,
    ):
        if event.type == "response.custom_tool_call_input.delta":
            deltas += event.delta
        if event.type == "response.custom_tool_call_input.done":
            assert event.input == deltas
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return deltas, final


def test_a_custom_call_matches_its_regex_whole_or_streamed(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess
) -> None:
    whole = _ask(bundled_client, bundled_server)
    (call,) = whole.output
    assert whole.status == "completed"
    assert call.type == "custom_tool_call" and call.name == "set_timer"
    assert re.fullmatch(REGEX, call.input), call.input
    deltas, final = _streamed(bundled_client, bundled_server, 60)
    assert deltas == call.input
    assert [item.input for item in final.output] == [call.input]
    assert final.tools[0].type == "custom"


LARK = 'start: cmd ("\\n" cmd)?\ncmd: "say \\"" WORDS "\\""\nWORDS: /[a-z]+( [a-z]+){0,3}/\n'
LARK_INPUT = re.compile(r'say "[a-z]+( [a-z]+){0,3}"(\nsay "[a-z]+( [a-z]+){0,3}")?')
LARK_TOOLS: list[Any] = [
    {
        "type": "custom",
        "name": "speak",
        "description": "Say something",
        "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
    }
]


def test_a_custom_call_parses_under_its_lark_grammar_whole_or_streamed(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess
) -> None:
    fields: dict[str, Any] = {
        "model": bundled_server.model_name,
        "input": "Say hello",
        "tools": LARK_TOOLS,
        "tool_choice": {"type": "custom", "name": "speak"},
        "temperature": 0,
        "max_output_tokens": 80,
    }
    whole = bundled_client.responses.create(**fields)
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "custom_tool_call" and call.name == "speak"
    assert LARK_INPUT.fullmatch(call.input), call.input
    deltas, final = "", None
    for event in bundled_client.responses.create(**fields, stream=True):
        if event.type == "response.custom_tool_call_input.delta":
            deltas += event.delta
        if event.type == "response.completed":
            final = event.response
    assert final is not None
    assert deltas == call.input == final.output[0].input  # type: ignore[union-attr]


@pytest.mark.parametrize("budget", [16, 23])  # inside the arguments, inside the input
def test_a_cut_custom_call_is_the_streamed_call(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, budget: int
) -> None:
    whole = _ask(bundled_client, bundled_server, max_output_tokens=budget)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    (call,) = whole.output
    assert call.type == "custom_tool_call"
    full = _ask(bundled_client, bundled_server).output[0].input
    assert full.startswith(call.input) and call.input != full
    deltas, final = _streamed(bundled_client, bundled_server, budget)
    assert deltas == call.input == final.output[0].input


def test_a_custom_call_and_its_output_continue_the_conversation(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess
) -> None:
    first = _ask(bundled_client, bundled_server)
    call = first.output[0]
    output = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "set"}
    stored = bundled_client.responses.create(
        model=bundled_server.model_name,
        previous_response_id=first.id,
        input=[output],  # type: ignore[list-item]
        tools=TOOLS,
        temperature=0,
        max_output_tokens=8,
    )
    sent_back = bundled_client.responses.create(
        model=bundled_server.model_name,
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "custom_tool_call",
                "call_id": call.call_id,
                "name": call.name,
                "input": call.input,
            },
            output,
        ],  # type: ignore[list-item]
        tools=TOOLS,
        temperature=0,
        max_output_tokens=8,
    )
    assert stored.usage is not None and sent_back.usage is not None
    assert stored.usage.input_tokens == sent_back.usage.input_tokens
    assert stored.output_text == sent_back.output_text


DEFINITION = "tools.0.format.definition"


@pytest.mark.parametrize(
    ("form", "param"),
    [
        (
            {"type": "grammar", "syntax": "regex", "definition": "(unclosed"},
            "tools.0.format.definition",
        ),
        *(
            ({"type": "grammar", "syntax": "lark", "definition": definition}, DEFINITION)
            for definition in (
                'start: "a" b',  # no rule b: llguidance refuses it
                'start: "a"\n%ignore " "',
                '%import common.WS\nstart: WS "a"',
                'start[lazy]: "a"',
                "start: /a/i",
            )
        ),
        ({"type": "grammar", "syntax": "ebnf", "definition": "x"}, "tools.0.format.syntax"),
        ({"type": "json"}, "tools.0.format.type"),
    ],
)
def test_a_format_that_cannot_be_enforced_is_a_400_naming_it(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess, form: dict[str, Any], param: str
) -> None:
    tool = {"type": "custom", "name": "t", "format": form}
    with pytest.raises(openai.BadRequestError) as refused:
        bundled_client.responses.create(
            model=bundled_server.model_name,
            input="x",
            tools=[tool],
            max_output_tokens=4,  # type: ignore[list-item]
        )
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_responses_fields_are_reported_refused_or_accepted(
    bundled_client: openai.OpenAI, bundled_server: ServerProcess
) -> None:
    raw = bundled_client.responses.with_raw_response.create(
        model=bundled_server.model_name,
        input="hi",
        max_output_tokens=3,
        service_tier="auto",
        reasoning={"effort": None},
        extra_body={"foo_bar": 1, "dry_multiplier": 0.5},
    )
    assert raw.headers["x-slotserve-ignored-fields"] == "dry_multiplier,foo_bar"
    quiet = bundled_client.responses.with_raw_response.create(
        model=bundled_server.model_name, input="hi", max_output_tokens=3, prompt_cache_key="k"
    )
    assert "x-slotserve-ignored-fields" not in quiet.headers
    with pytest.raises(openai.BadRequestError) as refused:
        bundled_client.responses.create(
            model=bundled_server.model_name, input="hi", max_output_tokens=3, max_tool_calls=2
        )
    assert refused.value.body["param"] == "max_tool_calls"  # type: ignore[index]
    assert refused.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


def test_messages_fields_are_reported_refused_or_accepted(bundled_server: ServerProcess) -> None:
    with anthropic.Anthropic(
        base_url=bundled_server.url, api_key="unused", max_retries=0
    ) as client:
        ask: Any = {
            "model": bundled_server.model_name,
            "messages": [{"role": "user", "content": "hi"}],
        }
        raw = client.messages.with_raw_response.create(
            **ask, max_tokens=3, extra_body={"foo_bar": 1, "speed": "fast"}
        )
        assert raw.headers["x-slotserve-ignored-fields"] == "foo_bar"
        counted = client.messages.with_raw_response.count_tokens(**ask, extra_body={"zzz": 1})
        assert counted.headers["x-slotserve-ignored-fields"] == "zzz"
        quiet = client.messages.with_raw_response.create(**ask, max_tokens=3)
        assert "x-slotserve-ignored-fields" not in quiet.headers
        output_format = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(**ask, max_tokens=3, extra_body={"output_config": output_format})
        assert "output_config" in str(refused.value)
    assert (
        "ignored request fields that no supported API defines: ['zzz']" in bundled_server.output()
    )
