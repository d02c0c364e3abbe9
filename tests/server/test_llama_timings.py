"""llama.cpp's ``timings_per_token``: with it, every chunk of a chat or text completion
stream after the role chunk carries llama.cpp's ``timings`` object for its choice up to
that chunk's token, the usage chunk (or a whole reply) the request's whole timings, and
their counts agree with the usage; without it, no reply carries the field (OpenAI's types
see only theirs). The tiny model on a real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_tool_calling import serve, write_long_tiny

FIELDS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = serve(write_long_tiny(tmp_path_factory.mktemp("timings")))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


def stream(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def check_timings(timings: dict[str, Any]) -> None:
    assert set(timings) <= FIELDS | {"draft_n", "draft_n_accepted"} and set(timings) >= FIELDS
    assert all(isinstance(v, int | float) and v >= 0 for v in timings.values())


BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}]},
    "/v1/completions": {"prompt": "hello there"},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_each_chunk_carries_its_timings(server: ServerProcess, path: str) -> None:
    body = {
        "model": server.model_name,
        **BODIES[path],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": True,
    }
    payloads = stream(server, path, body)
    *chunks, last = payloads
    if path == "/v1/chat/completions":  # the role chunk comes before any token
        assert "timings" not in chunks[0]
        chunks = chunks[1:]
    counts = []
    for chunk in chunks:
        check_timings(chunk["timings"])
        counts.append(chunk["timings"]["predicted_n"])
    assert counts == sorted(counts) and counts[0] >= 1
    usage, timings = last["usage"], last["timings"]
    check_timings(timings)
    assert last["choices"] == [] and timings["predicted_n"] == usage["completion_tokens"] == 10
    assert counts[-1] == 10
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0

    whole = httpx.post(server.url + path, json={**body, "stream": False}, timeout=120).json()
    check_timings(whole["timings"])
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]


@pytest.mark.parametrize("path", sorted(BODIES))
def test_no_timings_unless_asked(server: ServerProcess, path: str) -> None:
    body = {"model": server.model_name, **BODIES[path], "max_tokens": 4, "stream": True}
    assert all("timings" not in payload for payload in stream(server, path, body))
    whole = httpx.post(server.url + path, json={**body, "stream": False}, timeout=120).json()
    assert "timings" not in whole
