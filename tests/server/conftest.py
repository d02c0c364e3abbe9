"""A real `slotserve serve` process on a free loopback port, per test module: the tiny model's
(`tiny_server`, `client`) and the bundled model's (`bundled_server`, `bundled_client`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from slotserve.bench.processes import ServerProcess as BenchServerProcess
from slotserve.bench.processes import free_port, slotserve_command


class ServerProcess(BenchServerProcess):
    """``slotserve serve --model MODEL FLAGS…`` on a free port; stopped with SIGTERM."""

    def __init__(self, model: str, *flags: str) -> None:
        port = free_port()
        super().__init__(slotserve_command(model, port, *flags), port)


def strict_client(server: ServerProcess) -> openai.OpenAI:
    """The official OpenAI client on ``server``, validating responses strictly."""
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )


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


@pytest.fixture(scope="module")
def bundled_server() -> Iterator[ServerProcess]:
    """A server on the bundled model (SmolLM2-135M-Instruct), two slots, 2048 tokens each;
    named apart from the bundled model's own fixture (``bundled``)."""
    server = ServerProcess("bundled", "--max-seqs", "2", "--max-context", "2048")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture(scope="module")
def bundled_client(bundled_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The strict OpenAI client on `bundled_server`."""
    with strict_client(bundled_server) as client:
        yield client
