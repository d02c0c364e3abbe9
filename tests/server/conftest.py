"""A real `slotserve serve` process on a free loopback port, per test module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``slotserve serve`` with the given flags; stopped with SIGTERM."""

    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "slotserve.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            *flags,
        ]
        # Output goes to a file: a pipe nobody reads would block the server once full.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="slotserve-", suffix=".log")  # noqa: SIM115 (lives as long as the server)
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        """What the server printed so far."""
        self.log.flush()
        with open(self.log.name) as handle:
            return handle.read()

    @property
    def model_name(self) -> str:
        return str(httpx.get(self.url + "/v1/models").json()["data"][0]["id"])

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture(scope="module")
def tiny_server(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    server = ServerProcess(str(tiny_dirs["llama"]), "--max-seqs", "4", "--max-context", "256")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The official OpenAI client on the tiny-model server, validating responses strictly."""
    with openai.OpenAI(
        base_url=tiny_server.url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        yield client
