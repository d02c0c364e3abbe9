"""Issue 53, item 3: every chunk of every kind of stream (plain, tool calls required and
auto, structured, n > 1, with and without the usage chunk; chat and text completions)
has the shape OpenAI documents and its official client's types declare, checked chunk by
chunk in pydantic's strict mode with no field the types do not know: a role chunk first
for each choice (``content: null``, as OpenAI's tool-call streams and llama.cpp's server
begin; then every content delta holds text, as llama.cpp's clients require), tool calls
announced with index, id, type and name then argument fragments, one
``finish_reason`` per choice on an empty delta, and with ``include_usage`` a ``usage: null``
on every chunk but a last one whose ``choices`` are empty."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from pydantic import BaseModel

from tests.server.conftest import ServerProcess
from tests.server.test_tool_calling import serve, write_long_tiny

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = serve(write_long_tiny(tmp_path_factory.mktemp("streams")))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


def events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's payloads, up to ``[DONE]`` (which must end it)."""
    payloads: list[dict[str, Any]] = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        payloads.append(json.loads(line[len("data: ") :]))
    return payloads


def no_unknown_fields(value: Any, path: str = "chunk") -> None:
    """Every object of ``value`` (a parsed model) is one the client's types declare whole."""
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{path}: fields the types do not know: {value.model_extra}"
        for name in type(value).model_fields:
            no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            no_unknown_fields(item, f"{path}.{index}")


def check_usage(payloads: list[dict[str, Any]], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks with choices; with ``include_usage`` the last is the usage chunk."""
    if not include_usage:
        assert all("usage" not in p for p in payloads)
        return payloads
    *chunks, last = payloads
    assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
    assert all("usage" in p and p["usage"] is None for p in chunks)
    return chunks


CHAT_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "n2-usage": {"n": 2, "stream_options": {"include_usage": True}},
    "structured": {"response_format": {"type": "json_object"}, "logit_bias": {"95": 20}},
    "tools-required": {"tools": TOOLS, "tool_choice": "required"},
    "tools-auto-usage": {"tools": TOOLS, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_every_chat_chunk_has_openais_shape(server: ServerProcess, case: str) -> None:
    fields = CHAT_CASES[case]
    body = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 96,
        "temperature": 0.7,
        "seed": 2,
        **fields,
    }
    payloads = events(server, "/v1/chat/completions", body)
    for payload in payloads:
        no_unknown_fields(ChatCompletionChunk.model_validate(payload, strict=True))
        assert payload["object"] == "chat.completion.chunk"
        assert (payload["id"], payload["created"]) == (payloads[0]["id"], payloads[0]["created"])
    include_usage = bool(fields.get("stream_options"))
    chunks = check_usage(payloads, include_usage)
    calls_only = fields.get("tool_choice") == "required"
    for index in range(fields.get("n", 1)):
        deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks
                  if c["choices"][0]["index"] == index]  # fmt: skip
        assert all(len(c["choices"]) == 1 for c in chunks)
        first, _ = deltas[0]
        assert first == {"role": "assistant", "content": None, "refusal": None}
        assert all(delta.get("content") != "" for delta, _ in deltas[1:])
        assert all("role" not in delta for delta, _ in deltas[1:])
        finishes = [finish for _, finish in deltas if finish is not None]
        assert len(finishes) == 1 and deltas[-1] == ({}, finishes[0])
        announced: set[int] = set()
        for delta, _ in deltas[1:-1]:
            assert delta, "an empty delta before the end"
            for call in delta.get("tool_calls", []):
                if call["index"] not in announced:
                    assert set(call) == {"index", "id", "type", "function"}
                    assert call["type"] == "function" and call["function"]["arguments"] == ""
                    assert call["function"]["name"] == "get_weather"
                    announced.add(call["index"])
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {
                        "arguments"
                    }
        if calls_only:
            assert announced and all("content" not in delta for delta, _ in deltas[1:])
            assert finishes[0] in ("tool_calls", "length")


@pytest.mark.parametrize("include_usage", [False, True])
def test_every_text_completion_chunk_has_openais_shape(
    server: ServerProcess, include_usage: bool
) -> None:
    body: dict[str, Any] = {"model": server.model_name, "prompt": "a", "max_tokens": 6, "n": 2}
    body["ignore_eos"] = True  # every choice runs to its budget
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    payloads = events(server, "/v1/completions", body)
    for payload in payloads:
        # The client's Completion types a whole completion, whose finish_reason is set;
        # OpenAI's own streams send null until a choice's last chunk, as here.
        whole = {
            **payload,
            "choices": [
                {**c, "finish_reason": c["finish_reason"] or "stop"} for c in payload["choices"]
            ],
        }
        no_unknown_fields(Completion.model_validate(whole, strict=True))
        assert payload["object"] == "text_completion"
    chunks = check_usage(payloads, include_usage)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [c["finish_reason"] for c in mine][:-1] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length"
