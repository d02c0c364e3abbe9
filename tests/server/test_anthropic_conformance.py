"""Conformance of ``/v1/messages`` and ``/v1/messages/count_tokens`` to Anthropic's API types.

Anthropic publishes no OpenAPI document of its own in a stable public place: the SDKs are
generated from one (``.stats.yml``'s ``openapi_spec_url`` in anthropic-sdk-python points at
a Stainless storage bucket), and the copies found on the web are third parties'. So nothing
is copied into ``tests/data``: the raw JSON the server writes is judged by the official
``anthropic`` package's own pydantic models, generated from that spec. Each answer and each
streamed event is parsed in pydantic's strict mode (no coercion: ``"3"`` is not a count), and
since the SDK's models accept unknown fields, any field they do not define, at any depth, is
a failure too. Streamed events go by ``RawMessageStreamEvent`` (``ping`` and ``error`` as the
SDK reads them), each ``event:`` name equal to its payload's ``type``, in the order the API
documents: ``message_start``, then each content block's start, deltas and stop, then
``message_delta`` and ``message_stop``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from slotserve.server.chat.reasoning import CLOSE, OPEN
from tests.server.conftest import ServerProcess
from tests.server.scripted_model import chain_of, write_scripted_qwen3
from tests.server.spec_checks import SSE, json_events, stream_post
from tests.server.test_reasoning import ANSWER, REASONING
from tests.server.test_tool_calling import WEATHER, serve, write_long_tiny

anthropic = pytest.importorskip("anthropic")
types = anthropic.types

TOOLS: list[Any] = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
HI: list[Any] = [{"role": "user", "content": "hi"}]
BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


def unknown_fields(value: Any, where: str = "") -> list[str]:
    """The fields of ``value`` (a parsed SDK model, at any depth) that its models do not
    define: the SDK's models keep them as extras rather than refuse them."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        found += [f"{where}.{name}" for name in value.model_extra or {}]
        for name in type(value).model_fields:
            found += unknown_fields(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found += unknown_fields(item, f"{where}.{index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            found += unknown_fields(item, f"{where}.{key}")
    return found


def parsed(kind: Any, raw: str | bytes) -> Any:
    """``raw`` JSON parsed strictly as the SDK type ``kind``, with no field it lacks."""
    value = TypeAdapter(kind).validate_json(raw, strict=True)
    extras = unknown_fields(value)
    assert not extras, f"fields {kind} does not define: {extras}"
    return value


def parsed_events(events: list[SSE]) -> list[Any]:
    """Each event strictly as the SDK reads it: a stream event, a ping, or an error."""
    json_events(events)  # each event's name is its payload's type
    found: list[Any] = []
    for event in events:
        if event.event == "ping":
            assert json.loads(event.data) == {"type": "ping"}, event
        elif event.event == "error":
            found.append(parsed(types.ErrorResponse, event.data))
        else:
            found.append(parsed(types.RawMessageStreamEvent, event.data))
    return found


def check_order(events: list[Any]) -> None:
    """The documented order: one message_start, blocks opened, fed and closed one at a time
    by increasing index, then message_delta and message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index: int | None = None
    next_index = 0
    for event in events[1:-2]:
        assert event.type in BLOCK_EVENTS, kinds
        if event.type == "content_block_start":
            assert open_index is None and event.index == next_index, kinds
            open_index = event.index
        else:
            assert event.index == open_index, kinds
            if event.type == "content_block_stop":
                open_index, next_index = None, next_index + 1
    assert open_index is None, kinds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = serve(write_long_tiny(tmp_path_factory.mktemp("anthropic-conformance")))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


def post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def message(server: ServerProcess, **fields: Any) -> Any:
    """A whole message, strictly an SDK ``Message``."""
    body = {"model": server.model_name, "max_tokens": 8, "messages": HI, **fields}
    answer = post(server, "/v1/messages", body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    return parsed(types.Message, answer.content)


def stream(server: ServerProcess, **fields: Any) -> list[Any]:
    """A streamed message's events, strictly the SDK's, in the documented order."""
    body = {"model": server.model_name, "max_tokens": 8, "messages": HI, **fields}
    events = parsed_events(stream_post(server.url + "/v1/messages", body))
    check_order(events)
    return events


def test_text_messages_conform(server: ServerProcess) -> None:
    text = message(server, system="be brief", temperature=0)
    assert text.stop_reason == "max_tokens" and [b.type for b in text.content] == ["text"]
    events = stream(server, system="be brief", temperature=0)
    start, final = events[0], events[-2]
    assert start.message.content == [] and start.message.stop_reason is None
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    pieces = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(pieces) == text.content[0].text
    system_blocks = [{"type": "text", "text": "be brief"}]
    message(server, system=system_blocks, temperature=0, stop_sequences=["\n"])


def test_tool_use_conforms(server: ServerProcess) -> None:
    question: list[Any] = [{"role": "user", "content": "Paris?"}]
    ask: dict[str, Any] = {"max_tokens": 200, "tools": TOOLS, "messages": question}
    choice = {"type": "any", "disable_parallel_tool_use": True}
    call = message(server, tool_choice=choice, **ask)
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use"
    events = stream(server, tool_choice={"type": "tool", "name": "get_weather"}, **ask)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas and set(deltas) == {"input_json_delta"}
    assert events[-2].delta.stop_reason == "tool_use"
    turn = [
        *question,
        {
            "role": "assistant",
            "content": [block.model_dump(include={"type", "id", "name", "input"})],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "21C"}],
        },
    ]
    answer = message(server, **{**ask, "messages": turn}, tool_choice={"type": "none"})
    assert answer.content[0].type == "text"


def test_count_tokens_conforms(server: ServerProcess) -> None:
    body = {"model": server.model_name, "messages": HI, "tools": TOOLS}
    answer = post(server, "/v1/messages/count_tokens", body)
    assert answer.status_code == 200, answer.text
    assert parsed(types.MessageTokensCount, answer.content).input_tokens > 0


@pytest.mark.parametrize(
    "fields,status,kind",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error"),
        ({"model": "claude-x"}, 404, "not_found_error"),
        ({"system": 5}, 400, "invalid_request_error"),  # strict: a number is not a prompt
    ],
)
def test_errors_conform(
    server: ServerProcess, fields: dict[str, Any], status: int, kind: str
) -> None:
    body = {"model": server.model_name, "messages": HI, **fields}
    for route, budget in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
        answer = post(server, route, {**body, **budget})
        assert answer.status_code == status, answer.text
        error = parsed(types.ErrorResponse, answer.content)
        assert error.error.type == kind


def test_thinking_blocks_conform(tmp_path_factory: pytest.TempPathFactory) -> None:
    path: Path = tmp_path_factory.mktemp("thinker") / "model"
    write_scripted_qwen3(path, chain_of(OPEN, REASONING, CLOSE, ANSWER))
    thinker = ServerProcess(str(path), "--max-seqs", "2", "--max-context", "256")
    try:
        whole = message(thinker, max_tokens=32)
        assert [b.type for b in whole.content] == ["thinking", "text"]
        events = stream(thinker, max_tokens=32)
        deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
        assert "thinking_delta" in deltas and "text_delta" in deltas
    finally:
        assert thinker.stop() == 0
    assert "Traceback" not in thinker.output(), thinker.output()


def test_checks_catch_bad_answers(server: ServerProcess) -> None:
    """Control: reshaped answers and events fail the same checks."""
    body = {"model": server.model_name, "max_tokens": 4, "messages": HI}
    good = post(server, "/v1/messages", body).json()
    parsed(types.Message, json.dumps(good))
    bad_usage = {**good["usage"], "input_tokens": str(good["usage"]["input_tokens"])}
    for bad in (
        {**good, "stop_reason": "done"},
        {**good, "usage": bad_usage},  # strict: a string is not a count
        {**good, "role": "user"},
        {**good, "logprobs": []},  # a field the API does not define
        {**good, "content": [{**good["content"][0], "index": 0}]},
    ):
        with pytest.raises((ValidationError, AssertionError)):
            parsed(types.Message, json.dumps(bad))
    events = stream_post(server.url + "/v1/messages", body)
    parsed_events(events)
    renamed = [
        SSE("content_block_start", e.data) if e.event == "message_stop" else e for e in events
    ]
    with pytest.raises(AssertionError):
        parsed_events(renamed)
    typed = parsed_events(events)
    with pytest.raises(AssertionError):
        check_order([typed[0], *typed[2:]])  # a block fed before it is opened
    with pytest.raises(AssertionError):
        check_order(typed[:-1])  # no message_stop
