"""Soak (issue 27): no allocation after start grows with traffic. A real server on the
bundled model (the cell layout, its prefix cache on) serves a fixed mix for three rounds —
streamed and whole completions and chat turns that share a prefix (prefix hits), structured
outputs (``response_format`` ``json_schema``: two schemas every round and one new one, so
the grammar cache compiles, hits and evicts), cancels (the official client closes its
stream after two chunks) and disconnects (a raw socket reset mid-stream) — and its resident
set (VmRSS) once idle after each round, less the KV pool's resident pages (which become
resident as sessions first write them, up to the pool the plan reserves), stays within 2%
of what it was after the first."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from slotserve.bench.worst_case import proc_status
from tests.server.conftest import ServerProcess

ROUNDS, WORKERS = 3, 4
FLAGS = (
    *("--max-seqs", "4", "--max-context", "1024", "--kv-layout", "cell"),
    *("--grammar-max-bytes", "4MiB", "--grammar-cache-bytes", "6MiB", "--no-web"),
)
SYSTEM = (
    "You are the harbour master's assistant. Answer in one short sentence, name the pier, "
    "and never mention the weather unless asked."
)
TOKENS = 12


def _schema(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": [name],
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = ServerProcess("bundled", *FLAGS)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


class Traffic:
    """One round's requests, each a callable returning what it checked."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.model = server.model_name
        self.client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )

    def completion(self, i: int, stream: bool) -> str:
        prompt = f"{SYSTEM}\nShip {i} asks where to berth. The harbour master says:"
        if not stream:
            done = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=TOKENS, temperature=0
            )
            assert done.usage is not None and done.usage.completion_tokens >= 1
            return "completion"
        chunks = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=TOKENS, stream=True
        )
        assert sum(1 for _ in chunks) >= 1
        return "streamed completion"

    def chat(self, i: int) -> str:
        messages: Any = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Where does ship {i} berth?"},
        ]
        done = self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=TOKENS,
        )
        assert done.choices[0].message.content is not None
        return "chat"

    def structured(self, name: str) -> str:
        schema = _schema(name)
        done = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": f"Give the {name} as JSON."}],
            max_tokens=40,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema},
            },
        )
        choice = done.choices[0]
        if choice.finish_reason == "stop":  # a whole document: it follows the schema
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
        return "structured"

    def cancel(self, i: int) -> str:
        stream = self.client.completions.create(
            model=self.model,
            prompt=f"{SYSTEM}\nA long list of the ships in port, number {i}:",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for seen, _ in enumerate(stream):
            if seen == 1:
                break
        stream.close()
        return "cancel"

    def disconnect(self, i: int) -> str:
        """A streamed request on a raw socket, reset (RST) once the first bytes arrive."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": f"{SYSTEM}\nThe ferry timetable, edition {i}:",
                "max_tokens": 200,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=120) as sock:
            sock.sendall(head + body)
            received = b""
            while b"data: " not in received:
                chunk = sock.recv(4096)
                assert chunk, f"the server closed before streaming: {received!r}"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return "disconnect"

    def round(self, number: int) -> list[Callable[[], str]]:
        """20 requests: 6 completions (3 streamed), 4 chat turns, 4 structured (two schemas
        every round, one of this round's own), 3 cancels, 3 disconnects."""
        base = number * 100
        calls: list[Callable[[], str]] = []
        calls += [partial(self.completion, base + i, i % 2 == 0) for i in range(6)]
        calls += [partial(self.chat, base + i) for i in range(4)]
        for name in ("berth", "pier", "berth", f"tide_{number}"):
            calls.append(partial(self.structured, name))
        for i in range(3):
            calls += [partial(self.cancel, base + i), partial(self.disconnect, base + i)]
        order = [4, 10, 14, 0, 15, 6, 11, 1, 16, 7, 12, 2, 17, 8, 13, 3, 18, 9, 5, 19]
        return [calls[k] for k in order]  # the kinds interleaved, the same order every round


def _idle(server: ServerProcess, timeout_s: float = 60.0) -> None:
    """Wait until no session is live and no request queued (cancelled ones released)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        gauges = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(("slotserve_slots_in_use ", "slotserve_queue_length "))
        }
        if gauges and not any(gauges.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"the server did not go idle in {timeout_s:.0f} s")


def _gauges(server: ServerProcess, *names: str) -> dict[str, float]:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.split(" ")[0] in names
    }


def test_rss_does_not_grow_with_traffic(server: ServerProcess) -> None:
    traffic = Traffic(server)
    pid = server.process.pid
    after: list[int] = []
    kinds: dict[str, int] = {}
    for number in range(ROUNDS):
        with ThreadPoolExecutor(WORKERS) as pool:
            for kind in pool.map(lambda call: call(), traffic.round(number)):
                kinds[kind] = kinds.get(kind, 0) + 1
        _idle(server)
        rss = proc_status(pid)["VmRSS"]
        kv = _gauges(server, "slotserve_kv_resident_bytes", "slotserve_kv_pool_bytes")
        assert 0 < kv["slotserve_kv_resident_bytes"] <= kv["slotserve_kv_pool_bytes"]
        # The pool's pages become resident as sessions first write them, within its plan:
        # what must not grow is the rest.
        after.append(rss - int(kv["slotserve_kv_resident_bytes"]))
    assert kinds == {
        "completion": 9,
        "streamed completion": 9,
        "chat": 12,
        "structured": 12,
        "cancel": 9,
        "disconnect": 9,
    }
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    counters = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(("slotserve_prefix_hits_total ", "slotserve_cancellations_total "))
    }
    assert counters.get("slotserve_prefix_hits_total", 0) > 0, "no shared prefix was restored"
    assert counters.get("slotserve_cancellations_total", 0) >= 2 * 9  # cancels + disconnects
    mib = [f"{rss / 2**20:.1f}" for rss in after]
    print(f"VmRSS less the KV pool's resident pages, after each round (MiB): {mib}")
    for rss in after[1:]:
        assert abs(rss - after[0]) <= 0.02 * after[0], f"VmRSS less the KV pool (MiB): {mib}"
