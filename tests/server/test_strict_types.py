"""Request bodies are typed strictly, as OpenAI's API types them (issue 30, defect 7): an
integer is never a boolean, a string or a decimal number, a number never a boolean, a
boolean only true or false, a logit_bias key only ASCII digits. Each is a 400 whose
``param`` names the field, on every route: chat and text completions, the Responses API
and Anthropic's Messages (whose error shape has no ``param``: its message names the
field). Errors about a field carry ``param`` (a seed past 64 bits, a prompt token id
outside the vocabulary). In-process: the app around a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.server import create_app

NAME = "tiny"
VOCAB = 272  # slotserve.testing.TINY_VOCAB


@pytest.fixture(scope="module")
def app_client(tiny_dirs: dict[str, Path]) -> Iterator[TestClient]:
    engine = ss.Engine(ss.load(tiny_dirs["llama"]), ss.EngineConfig(max_seqs=2, max_context=128))
    with TestClient(create_app(engine, NAME)) as client:
        yield client
    engine.close()


def chat(**fields: Any) -> dict[str, Any]:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {**body, **fields}


def text(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "prompt": "hi", "max_tokens": 2, **fields}


def refused(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 400, (body, response.text)
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (route, body, the param the 400 must name, a word the message must hold)
LAX = [
    (COMPLETIONS, text(max_tokens="5"), "max_tokens", "string"),
    (COMPLETIONS, text(max_tokens=True), "max_tokens", "boolean"),
    (COMPLETIONS, text(max_tokens=5.0), "max_tokens", "decimal"),
    (COMPLETIONS, text(n=True), "n", "boolean"),
    (COMPLETIONS, text(temperature=True), "temperature", "boolean"),
    (COMPLETIONS, text(temperature="0.5"), "temperature", "string"),
    (COMPLETIONS, text(stream=1), "stream", "integer"),
    (COMPLETIONS, text(stream="true"), "stream", "string"),
    (COMPLETIONS, text(prompt=[True]), "prompt.0", "boolean"),
    (COMPLETIONS, text(prompt=[[1, False]]), "prompt.0.1", "boolean"),
    (COMPLETIONS, text(prompt=5), "prompt", "integer"),
    (COMPLETIONS, text(logit_bias={"\u0663": 1}), "logit_bias", "ASCII"),
    (COMPLETIONS, text(logit_bias={" 3": 1}), "logit_bias", "ASCII"),
    (COMPLETIONS, text(logit_bias={"3": True}), "logit_bias.3", "boolean"),
    (COMPLETIONS, text(logprobs=True), "logprobs", "boolean"),
    (COMPLETIONS, text(echo=1), "echo", "integer"),
    (COMPLETIONS, text(seed="1"), "seed", "string"),
    (COMPLETIONS, text(seed=2**64), "seed", "18446744073709551615"),
    (COMPLETIONS, text(seed=-(2**63) - 1), "seed", "-9223372036854775808"),
    (COMPLETIONS, text(stop=5), "stop", "integer"),
    (COMPLETIONS, text(stop=["a", 5]), "stop.1", "integer"),
    (COMPLETIONS, text(stream_options={"include_usage": 1}), "stream_options.include_usage", "1"),
    (COMPLETIONS, text(best_of=True), "best_of", "best_of"),
    (CHAT, chat(max_completion_tokens="5"), "max_completion_tokens", "string"),
    (CHAT, chat(n=True), "n", "boolean"),
    (CHAT, chat(logprobs=1), "logprobs", "integer"),
    (CHAT, chat(top_logprobs=True, logprobs=True), "top_logprobs", "boolean"),
    (CHAT, chat(parallel_tool_calls="no"), "parallel_tool_calls", "string"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages.0.content", "integer"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages.0.content.0.text",
        "integer",
    ),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "strict": 1}}]),
        "tools.0.function.strict",
        "integer",
    ),
    (CHAT, chat(tool_choice={"type": "function"}), "tool_choice.function", "required"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"strict": "yes"}}),
        "response_format.json_schema.strict",
        "string",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "word"), LAX)
def test_lax_values_are_400_naming_the_field(
    app_client: TestClient, path: str, body: dict[str, Any], param: str, word: str
) -> None:
    error = refused(app_client, path, body)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and word in error["message"], error


@pytest.mark.parametrize(
    "body",
    [
        text(temperature=1),  # a number takes an integer
        text(top_p=1, presence_penalty=0),
        text(logit_bias={"3": 1, "271": -100}),
        text(seed=2**64 - 1, n=2),  # the second choice's seed wraps, still 64 bits
        text(seed=-(2**63)),
        text(prompt=[1, 2, 3]),
        text(prompt=[[1, 2, 3]]),
        text(prompt=["hi"]),
    ],
)
def test_strict_values_are_served(app_client: TestClient, body: dict[str, Any]) -> None:
    response = app_client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text


def test_logit_bias_with_an_arabic_digit_biases_nothing(app_client: TestClient) -> None:
    """The defect itself: "٣" once biased token 3; now it is refused, and "3" still works."""
    error = refused(app_client, COMPLETIONS, text(logit_bias={"\u0663": 100}))
    assert "'\u0663'" in error["message"]
    forced = app_client.post(
        COMPLETIONS, json=text(logit_bias={"3": 100}, temperature=0, max_tokens=3)
    )
    assert forced.status_code == 200, forced.text
    assert forced.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("prompt", [[5, VOCAB], [-1], [[VOCAB + 100]]])
def test_prompt_token_outside_the_vocabulary_names_prompt(
    app_client: TestClient, prompt: list[Any]
) -> None:
    error = refused(app_client, COMPLETIONS, text(prompt=prompt))
    assert error["param"] == "prompt", error
    assert f"0..{VOCAB - 1}" in error["message"]


def test_not_an_object_is_400_with_no_field(app_client: TestClient) -> None:
    error = refused(app_client, COMPLETIONS, [1, 2])  # type: ignore[arg-type]
    assert error["param"] is None and "an array" in error["message"], error


RESPONSES = "/v1/responses"


def response_body(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "input": "hi", "max_output_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (response_body(max_output_tokens="5"), "max_output_tokens"),
        (response_body(max_output_tokens=True), "max_output_tokens"),
        (response_body(temperature=True), "temperature"),
        (response_body(stream=1), "stream"),
        (response_body(store="no"), "store"),
        (response_body(top_p=True), "top_p"),
        (response_body(seed=2**64), "seed"),
        (response_body(parallel_tool_calls=0), "parallel_tool_calls"),
        (response_body(input=[True]), "input.0"),
        (
            response_body(input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
            "input.0.content.0.text",
        ),
        (
            response_body(input=[{"type": "function_call", "call_id": 1, "name": "f"}]),
            "input.0.call_id",
        ),
        (response_body(input=[{"role": "user", "content": 5}]), "input.0.content"),
        (
            response_body(instructions="be brief", input=[{"role": 3, "content": "x"}]),
            "input.0.role",
        ),
        (response_body(tool_choice={"type": "function", "name": 5}), "tool_choice.name"),
    ],
)
def test_responses_lax_values_are_400_naming_the_field(
    app_client: TestClient, body: dict[str, Any], param: str
) -> None:
    error = refused(app_client, RESPONSES, body)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


def test_responses_strict_values_are_served(app_client: TestClient) -> None:
    response = app_client.post(RESPONSES, json=response_body(temperature=1, top_p=1))
    assert response.status_code == 200, response.text


MESSAGES = "/v1/messages"


def message_body(**fields: Any) -> dict[str, Any]:
    body = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, **fields}


def blocks(*content: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(content)}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (message_body(max_tokens="5"), "max_tokens"),
        (message_body(max_tokens=True), "max_tokens"),
        (message_body(stream=1), "stream"),
        (message_body(temperature=True), "temperature"),
        (message_body(top_k=True), "top_k"),
        (message_body(stop_sequences=[1]), "stop_sequences.0"),
        (message_body(messages=blocks({"type": "text", "text": 5})), "messages.0.content.0.text"),
        (
            message_body(
                messages=blocks(
                    {"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": 1}
                )
            ),
            "messages.0.content.0.is_error",
        ),
        (
            message_body(tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"}),
            "tool_choice.disable_parallel_tool_use",
        ),
        (message_body(system=[{"type": "text", "text": True}]), "system.0.text"),
    ],
)
def test_messages_lax_values_are_400_naming_the_field(
    app_client: TestClient, body: dict[str, Any], param: str
) -> None:
    response = app_client.post(MESSAGES, json=body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith(f"{param}: "), answer


def test_messages_strict_values_are_served(app_client: TestClient) -> None:
    response = app_client.post(MESSAGES, json=message_body(temperature=1, top_k=5))
    assert response.status_code == 200, response.text
