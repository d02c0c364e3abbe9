"""``/v1/messages`` with the official anthropic client (strict response validation) against a
real server on the tiny random model: a message, a stream, a tool-use round trip, stop
sequences, token counting, and the API's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from slotserve.server.anthropic.messages import error_response
from tests.server.conftest import ServerProcess
from tests.server.test_tool_calling import WEATHER, serve, write_long_tiny

anthropic = pytest.importorskip("anthropic")

TOOLS: list[Any] = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
HI: list[Any] = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}  # this client version has no temperature argument


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = serve(write_long_tiny(tmp_path_factory.mktemp("anthropic")))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Any]:
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def test_message_and_stream(client: Any, server: ServerProcess) -> None:
    ask = {"model": server.model_name, "max_tokens": 8, "system": "be brief", "messages": HI}
    message = client.messages.create(**ask, extra_body=GREEDY)
    assert message.role == "assistant" and message.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "text" and message.usage.output_tokens == 8
    assert message.usage.input_tokens > 0
    with client.messages.stream(**ask, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequences(client: Any, server: ServerProcess) -> None:
    ask = {"model": server.model_name, "max_tokens": 30, "messages": HI, "extra_body": GREEDY}
    text = client.messages.create(**ask).content[0].text
    stop = text[4:6]
    stopped = client.messages.create(**ask, stop_sequences=["never there", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_tool_use_round_trip(client: Any, server: ServerProcess) -> None:
    question: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    ask = {"model": server.model_name, "max_tokens": 200, "tools": TOOLS}
    first = client.messages.create(
        **ask, messages=question, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(
        **ask, messages=question, tool_choice={"type": "tool", "name": "get_weather"}
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[0].type == "tool_use"
    jsonschema.validate(streamed.content[0].input, WEATHER)
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == streamed.content[0].input
    turn = [
        *question,
        {
            "role": "assistant",
            "content": [call.model_dump(include={"type", "id", "name", "input"})],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21C"}],
        },
    ]
    answer = client.messages.create(**ask, messages=turn, tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens(client: Any, server: ServerProcess) -> None:
    plain = client.messages.count_tokens(model=server.model_name, messages=HI)
    with_tools = client.messages.count_tokens(model=server.model_name, messages=HI, tools=TOOLS)
    assert 0 < plain.input_tokens < with_tools.input_tokens  # the tools are in the prompt


def test_errors_in_the_api_shape(client: Any, server: ServerProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=server.model_name, max_tokens=4, messages=[{"role": "robot", "content": "x"}]
        )
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-x", max_tokens=4, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]
    with pytest.raises(anthropic.BadRequestError) as unanswered:
        client.messages.create(model=server.model_name, max_tokens=4, messages=orphan)
    message = unanswered.value.body["error"]["message"]
    assert message.startswith("messages.0.content.0.tool_use_id: 't1' answers no tool_use")


@pytest.mark.parametrize(
    "status,kind,answered",
    [(429, "rate_limit_error", 429), (503, "overloaded_error", 529), (500, "api_error", 500)],
)
def test_refusals_map_to_the_api_statuses(status: int, kind: str, answered: int) -> None:
    response = error_response(status, "busy", {"Retry-After": "1"})
    assert response.status_code == answered
    body = json.loads(bytes(response.body))
    assert body == {"type": "error", "error": {"type": kind, "message": "busy"}}
