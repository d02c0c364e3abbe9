"""SIGTERM or SIGINT while requests run: the server cancels them, answers every client and
exits 0 fast.

Before, uvicorn waited its grace period for the running requests (which the engine kept
generating), then cut them: streams ended mid-body with no finish and no ``[DONE]``, a
non-streamed request got a plain-text 500, and ``CancelledError`` tracebacks were logged.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.server import create_app
from tests.server.conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0.8, "seed": 3}
EXIT_WITHIN_S = 2.0


@dataclass
class StreamLog:
    """The ``data:`` payloads one streamed request received, as they came."""

    events: list[str] = field(default_factory=list)
    status: int | None = None
    failure: BaseException | None = None


def read_stream(server: ServerProcess, body: dict[str, Any], log: StreamLog) -> None:
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", server.url + "/v1/completions", json=body) as response,
        ):
            log.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    log.events.append(line.removeprefix("data: "))
    except BaseException as exc:  # the test reports it; a thread cannot raise to pytest
        log.failure = exc


def post_once(server: ServerProcess, body: dict[str, Any], out: list[httpx.Response]) -> None:
    with httpx.Client(timeout=60) as client:
        out.append(client.post(server.url + "/v1/completions", json=body))


def busy_slots(server: ServerProcess) -> int:
    slots = httpx.get(server.url + "/slots", timeout=5).json()
    return sum(slot["state"] != "idle" for slot in slots)


def wait_for(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_ends_cleanly(log: StreamLog) -> None:
    """A finish chunk (a finish_reason) or an error event, then ``[DONE]``, nothing after."""
    assert log.failure is None, repr(log.failure)
    assert log.status == 200
    assert log.events[-1] == "[DONE]", log.events[-3:]
    last = json.loads(log.events[-2])
    if "error" in last:
        error = last["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
    else:
        assert last["choices"][0]["finish_reason"] is not None, last
    tokens = [e for e in log.events[:-2] if "choices" in json.loads(e)]
    assert tokens, "the stream was cut before any token: SIGTERM came too early"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_cancels_open_requests_and_exits_0(signum: signal.Signals) -> None:
    server = ServerProcess("bundled", "--max-seqs", "3", "--max-context", "512")
    streams = [StreamLog(), StreamLog()]
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=read_stream, args=(server, {**LONG, "prompt": p, "stream": True}, log)
        )
        for p, log in zip(("Once upon a time", "The river"), streams, strict=True)
    ]
    threads.append(
        threading.Thread(target=post_once, args=(server, {**LONG, "prompt": "Hello"}, answers))
    )
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(len(s.events) >= 3 for s in streams), "tokens on both streams")
        wait_for(lambda: busy_slots(server) == 3, "the non-streamed request to run")
        signalled = time.monotonic()
        server.process.send_signal(signum)
        status = server.process.wait(30)
        exited_after = time.monotonic() - signalled
        for thread in threads:
            thread.join(30)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    output = server.output()
    assert status == 0, output
    assert exited_after < EXIT_WITHIN_S, f"exited {exited_after:.2f}s after {signum.name}"
    for log in streams:
        assert_ends_cleanly(log)
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_once_shutting_down_new_requests_get_503_json(tiny_dirs: dict[str, Path]) -> None:
    engine = ss.Engine(ss.load(tiny_dirs["llama"]), ss.EngineConfig(max_seqs=1, max_context=64))
    try:
        app = create_app(engine, "tiny")
        client = TestClient(app)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        app.state.server.stop_admitting()  # what the signal handler does, first of all
        for method, path, payload in [
            ("POST", "/v1/completions", body),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}),
            ("POST", "/tokenize", {"text": "hi"}),
        ]:
            response = client.request(method, path, json=payload)
            assert response.status_code == 503, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "server_error" and "shutting down" in error["message"]
        assert client.get("/health").status_code == 503
    finally:
        engine.close()
