"""``/v1/responses`` with the official openai client (strict) against real servers: text
and function-call items, whole and streamed, a tool result sent back, and (the bundled
model, whose replies tokenise back to themselves) continuations by
``previous_response_id`` served from the prefix cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess, strict_client
from tests.server.test_tool_calling import WEATHER, serve, write_long_tiny

TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = serve(write_long_tiny(tmp_path_factory.mktemp("responses")))
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def create(server: ServerProcess, **kwargs: Any) -> Any:
    with strict_client(server) as client:
        if kwargs.get("stream"):
            return list(client.responses.create(model=server.model_name, **kwargs))
        return client.responses.create(model=server.model_name, **kwargs)


def test_text_whole_and_streamed(tiny: ServerProcess) -> None:
    ask = {"input": "hello", "instructions": "be brief", "max_output_tokens": 8, "temperature": 0}
    whole = create(tiny, **ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.output[0].type == "message"
    events = create(tiny, stream=True, **ask)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def arguments_valid(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_function_calls_and_their_results(tiny: ServerProcess) -> None:
    first = create(
        tiny,
        input="weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body={"seed": 1},
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments_valid(call.arguments)
    events = create(
        tiny,
        input="weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        stream=True,
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and events[-1].type == "response.completed"
    fragments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert fragments == done[0].arguments == events[-1].response.output[0].arguments
    arguments_valid(fragments)
    # The result goes back as an item of the next turn, which continues the first.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    answer = create(
        tiny,
        input=[result],
        previous_response_id=first.id,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
    )
    assert answer.output[0].type == "message" and answer.previous_response_id == first.id


def test_bad_input_is_400_naming_the_field(tiny: ServerProcess) -> None:
    def refused(**body: Any) -> str:
        response = httpx.post(
            tiny.url + "/v1/responses", json={"model": tiny.model_name, "input": "hi", **body}
        )
        assert response.status_code == 400, response.text
        param: str = response.json()["error"]["param"]
        return param

    assert refused(previous_response_id="resp_nope") == "previous_response_id"
    assert refused(tools=[{"type": "web_search"}]) == "tools.0.type"
    assert refused(input=[{"type": "image_generation_call"}]) == "input.0.type"
    orphan = [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
    assert refused(input=orphan).startswith("input.")


def test_store_false_keeps_nothing(tiny: ServerProcess) -> None:
    kept = create(tiny, input="a", max_output_tokens=2)
    with strict_client(tiny) as client:
        assert client.responses.retrieve(kept.id).id == kept.id
        unkept = create(tiny, input="a", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            create(tiny, input="b", previous_response_id=unkept.id, max_output_tokens=2)


def test_continuations_are_served_from_the_prefix_cache() -> None:
    server = ServerProcess(
        "bundled", "--max-context", "512", "--kv-layout", "cell", "--prefix-cache", "8MiB"
    )
    try:
        # Instructions do not carry over: each turn gives its own (here the same).
        ask = {"max_output_tokens": 8, "temperature": 0, "instructions": "be kind"}
        first = create(server, input="tell me something", **ask)
        for follow_up in ("and more", "something else"):  # two forks of the same response
            turn = create(server, input=follow_up, previous_response_id=first.id, **ask)
            cached = turn.usage.input_tokens_details.cached_tokens
            # More than the first prompt: its reply, kept in the cache, is restored too.
            assert first.usage.input_tokens < cached < turn.usage.input_tokens
    finally:
        assert server.stop() == 0


def post(server: ServerProcess, **body: Any) -> httpx.Response:
    payload = {"model": server.model_name, "input": "hi", "max_output_tokens": 1, **body}
    return httpx.post(server.url + "/v1/responses", json=payload, timeout=60)


def refusal(server: ServerProcess, **body: Any) -> dict[str, Any]:
    """The error of a request that must be a 400 in OpenAI's shape."""
    response = post(server, **body)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{error['param']}: "), error
    return error


def test_unsupported_fields_are_refused_unless_they_ask_for_the_default(
    tiny: ServerProcess,
) -> None:
    refused = {
        "background": True,
        "truncation": "auto",
        "include": ["message.output_text.logprobs"],
        "conversation": "conv_123",
    }
    for name, value in refused.items():
        error = refusal(tiny, **{name: value})
        assert error["param"] == name and error["code"] == "unsupported_parameter", error
        assert json.dumps(value) in error["message"] and "supports only" in error["message"]
    defaults = {"background": False, "truncation": "disabled", "include": [], "conversation": None}
    assert post(tiny, **defaults).status_code == 200
    assert create(tiny, input="a", max_output_tokens=1, truncation="disabled").status


def test_metadata_is_bounded_as_openai_bounds_it(tiny: ServerProcess) -> None:
    most = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}  # 16 pairs, 64/512 chars
    assert create(tiny, input="a", max_output_tokens=1, metadata=most).metadata == most
    error = refusal(tiny, metadata={**most, "one": "more"})
    assert error["param"] == "metadata" and "at most 16" in error["message"]
    error = refusal(tiny, metadata={"k" * 65: "v"})
    assert error["param"] == "metadata" and "at most 64 characters" in error["message"]
    error = refusal(tiny, metadata={"big": "v" * 513})
    assert error["param"] == "metadata.big" and "at most 512 characters" in error["message"]


def call(call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
    item = {"type": "function_call", "call_id": call_id, "arguments": arguments}
    return item if name is None else {**item, "name": name}


def test_refusals_name_the_responses_fields_not_chats(tiny: ServerProcess) -> None:
    """Chat's fields (``messages``, ``tool_calls``, ``tool_call_id``, ``function``,
    ``response_format``) never appear: each error names the item the client sent, counted
    in ``input`` as sent (a reasoning item dropped, function calls merged, after the
    instructions and a stored conversation)."""
    reasoning = {"type": "reasoning", "summary": []}
    user = {"role": "user", "content": "hi"}
    first = create(tiny, input="a", max_output_tokens=1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": [reasoning, {"role": "user", "content": 5}]}, "input.1.content"),
        ({"input": [reasoning, {"role": "tool", "content": "x"}]}, "input.1.role"),
        ({"input": [user, call("a", "f", "{}"), call("b", "g", "not json")]}, "input.2.arguments"),
        ({"input": [call("a", None, "{}")]}, "input.0.name"),
        (
            {"input": [user, {"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "input.1.call_id",
        ),
        ({"input": []}, "input"),
        (
            {
                "input": [reasoning, call("a", "f", "[1]")],
                "instructions": "be brief",
                "previous_response_id": first.id,
            },
            "input.1.arguments",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [{"type": "function", "name": 5}]}, "tools.0.name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
            "text.format.schema",
        ),
    ]
    for body, param in cases:
        error = refusal(tiny, **body)
        assert error["param"] == param, (body, error)
        for chat_name in ("messages", "tool_calls", "tool_call_id", "function.", "response_format"):
            assert chat_name not in error["message"], (body, error)
