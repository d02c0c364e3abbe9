"""Hostile input at the HTTP edge: invalid Unicode, bad JSON, a prompt that fills the
context, trailing slashes with a forged Host, half-open connections, an exposed bind.

Each case is answered with a 4xx OpenAI error (never a 500), and the connection it came on
stays usable; connections that never finish a request head are closed.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess

HEADER_TIMEOUT_S = 1.0
MAX_CONTEXT = 256
MODEL = "llama"  # the tiny model's directory name, which is its served name
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    process = ServerProcess(
        str(tiny_dirs["llama"]),
        "--max-seqs",
        "2",
        "--max-context",
        str(MAX_CONTEXT),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
    )
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


def chat_body(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def text_body(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}


# json.dumps writes a lone surrogate as the escape "\ud800", as a hostile client would.
LONE = "\ud800"
INVALID_UNICODE = [
    ("/v1/completions", text_body(f"a{LONE}b"), "prompt"),
    ("/v1/completions", text_body([f"a{LONE}"]), "prompt.0"),
    ("/v1/completions", text_body("\ude00\ud83d"), "prompt"),  # a pair in the wrong order
    ("/v1/completions", {**text_body("hi"), "model": LONE}, "model"),
    ("/v1/completions", text_body("hi", stop=["x", LONE]), "stop.1"),
    ("/v1/completions", text_body("hi", user=LONE), "user"),
    ("/v1/chat/completions", chat_body(f"hi{LONE}"), "messages.0.content"),
    (
        "/v1/chat/completions",
        chat_body([{"type": "text", "text": LONE}]),
        "messages.0.content.0.text",
    ),
    ("/v1/chat/completions", {**chat_body("hi"), "model": LONE}, "model"),
    ("/tokenize", {"text": LONE}, "text"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
]


def exchange(
    connection: http.client.HTTPConnection, path: str, body: bytes
) -> tuple[int, dict[str, Any], str | None]:
    """POST ``body`` as JSON; the status, the decoded answer and its Connection header."""
    connection.request("POST", path, body=body, headers=JSON)
    response = connection.getresponse()
    answer = json.loads(response.read())
    return response.status, answer, response.getheader("connection")


def assert_still_usable(connection: http.client.HTTPConnection, sock: Any) -> None:
    """A next request on the same keep-alive connection is served on the same socket."""
    status, answer, _ = exchange(connection, "/tokenize", json.dumps({"text": "ok"}).encode())
    assert status == 200 and answer["count"] > 0
    assert connection.sock is sock, "the server closed the connection"


@pytest.mark.parametrize(("path", "body", "param"), INVALID_UNICODE)
def test_invalid_unicode_is_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.connect()
        sock = connection.sock
        status, answer, closing = exchange(connection, path, json.dumps(body).encode())
        assert status == 400, answer
        error = answer["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "surrogate" in error["message"] and param in error["message"]
        assert closing != "close"
        assert_still_usable(connection, sock)
    finally:
        connection.close()


def test_invalid_utf8_bytes_are_400_and_keep_the_connection(server: ServerProcess) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.connect()
        sock = connection.sock
        raw = b'{"model": "llama", "prompt": "a\xff\xfeb", "max_tokens": 2}'
        status, answer, _ = exchange(connection, "/v1/completions", raw)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        assert_still_usable(connection, sock)
    finally:
        connection.close()


def test_surrogate_pairs_are_valid_text(server: ServerProcess) -> None:
    paired = b'{"text": "smile \\ud83d\\ude00"}'  # the JSON escapes of one emoji
    response = httpx.post(server.url + "/tokenize", content=paired, headers=JSON)
    assert response.status_code == 200, response.text


def test_json_decode_error_names_no_offset(server: ServerProcess) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        content=b'{"model": "llama", "prompt": "hi" "max_tokens": 2}',
        headers=JSON,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None, error
    assert "not valid JSON" in error["message"]


def test_prompt_that_fills_the_context_is_context_length_exceeded(server: ServerProcess) -> None:
    url = server.url + "/v1/completions"
    full = httpx.post(url, json=text_body([5] * MAX_CONTEXT, max_tokens=None), timeout=30)
    assert full.status_code == 400, full.text
    error = full.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert str(MAX_CONTEXT) in error["message"]
    room_for_one = httpx.post(url, json=text_body([5] * (MAX_CONTEXT - 1), max_tokens=None))
    assert room_for_one.status_code == 200, room_for_one.text
    assert room_for_one.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", text_body("x " * 300, max_tokens=4), "prompt"),
        ("/v1/completions", text_body([5] * 250, max_tokens=20), "prompt"),  # with its budget
        ("/v1/chat/completions", chat_body("x " * 300), "messages"),
    ],
)
def test_over_long_prompt_is_context_length_exceeded(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert f"max_context={MAX_CONTEXT}" in error["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models/"), ("POST", "/v1/completions/"), ("GET", "/health/")],
)
def test_trailing_slash_never_redirects_to_the_given_host(
    server: ServerProcess, method: str, path: str
) -> None:
    response = httpx.request(
        method,
        server.url + path,
        headers={"Host": "attacker.example"},
        json={"model": MODEL, "prompt": "hi"} if method == "POST" else None,
        follow_redirects=False,
    )
    assert not response.is_redirect and "location" not in response.headers
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), or None if it did not."""
    start = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /health HT", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"],
    ids=["nothing", "part of a request line", "part of the headers"],
)
def test_half_open_connection_is_closed(server: ServerProcess, sent: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        waited = closed_within(sock, HEADER_TIMEOUT_S + 4)
    assert waited is not None, "the server still holds the connection"
    assert waited < HEADER_TIMEOUT_S + 2


def test_trickled_request_head_is_closed_at_the_deadline(server: ServerProcess) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        try:
            for byte in head:  # a byte every 50 ms: the whole head would take 12 s
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
                assert time.monotonic() - start < HEADER_TIMEOUT_S + 3, "still open"
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            pytest.fail("the server took the whole trickled head")
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 3


def test_kept_alive_connection_serves_requests_after_the_deadline(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        time.sleep(HEADER_TIMEOUT_S + 0.5)  # idle, inside the keep-alive period
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("host", "api_key", "warns"),
    [
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.168.1.20", None, True),
        ("my-box.local", None, True),
        ("0.0.0.0", "sekret", False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
    ],
)
def test_exposed_bind_without_api_key_warns(
    caplog: pytest.LogCaptureFixture, host: str, api_key: str | None, warns: bool
) -> None:
    from slotserve.server.http.serve import (
        warn_if_exposed,  # here: the module's other tests stand alone
    )

    with caplog.at_level(logging.WARNING, logger="slotserve"):
        assert warn_if_exposed(host, api_key) is warns
    warned = [r for r in caplog.records if r.name == "slotserve" and "--api-key" in r.message]
    assert bool(warned) is warns
