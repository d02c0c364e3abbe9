"""Soak with every feature on at once (the disk tier's deadlock): a real server on the
bundled model with the prefix cache small enough that conversations are evicted to its
disk tier and restored from it (``--prefix-store``), serving six clients a mix of chat
turns that continue their conversations, streamed chat, tool calls, structured outputs,
embeddings, the Responses API (chained by ``previous_response_id``), Anthropic messages,
cancels (a stream closed early) and disconnects (a socket reset mid-stream), with the
server's garbage collector forced often so that dropped handles' finalizers run on
whatever thread allocates, the store's writer included. Before the fix the server hung
within a minute or two (every thread asleep on a lock, ``/health`` silent, SIGTERM
ignored). Throughout, ``/health`` answers within a second; after: no 5xx, every slot and
block back but what the cache's snapshots pin, the lock order never inverted (the server
checks it, ``SLOTSERVE_LOCK_CHECK``), and a greedy answer is what it was before the load."""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.bench.processes import ServerProcess, free_port

LOAD_S = 75.0
CLIENTS = 6
HEALTH_EVERY_S = 0.25
HEALTH_LIMIT_S = 1.0
# The server in a fresh interpreter whose collector runs every 100 allocations.
SERVE = (
    "import gc, sys; gc.set_threshold(100, 5, 5); "
    "from slotserve.cli import main; sys.exit(main(sys.argv[1:]))"
)
SYSTEM = (
    "You are the harbour master's assistant. Answer in one short sentence, name the pier, "
    "and never mention the weather unless asked. The piers are North, South and Ferry."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_berth",
            "description": "Assign a ship to a pier.",
            "parameters": {
                "type": "object",
                "properties": {"ship": {"type": "string"}, "pier": {"type": "string"}},
                "required": ["ship", "pier"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"pier": {"type": "string", "enum": ["North", "South", "Ferry"]}},
    "required": ["pier"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("store")
    port = free_port()
    command = [sys.executable, "-c", SERVE, "serve", "--model", "bundled", "--port", str(port)]
    command += ["--kv-layout", "cell", "--max-seqs", "4", "--max-context", "1024"]
    command += ["--queue-depth", "16", "--prefix-cache", "4MiB", "--prefix-store", str(store)]
    command += ["--prefix-store-bytes", "512MiB", "--prefix-store-min-tokens", "16", "--no-web"]
    server = ServerProcess(command, port)
    yield server
    assert server.stop() == 0, server.output()[-4000:]


class Load:
    """The clients' requests; every status is counted, and a 5xx or a transport error is
    recorded with what was asked."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.url = server, server.url
        self.model = server.model_name
        self.statuses: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def _count(self, kind: str, status: int, detail: str = "") -> None:
        with self.lock:
            self.statuses[status] += 1
            self.kinds[kind] += 1
            if status >= 500:
                self.failures.append(f"{kind}: {status} {detail[:300]}")

    def post(self, client: httpx.Client, kind: str, path: str, body: dict[str, Any]) -> Any:
        reply = client.post(self.url + path, json=body)
        self._count(kind, reply.status_code, reply.text)
        return reply.json() if reply.status_code == 200 else None

    def stream(self, client: httpx.Client, kind: str, body: dict[str, Any], stop: int) -> None:
        """A streamed chat, closed after ``stop`` events (a cancel) or read whole."""
        with client.stream("POST", self.url + "/v1/chat/completions", json=body) as reply:
            self._count(kind, reply.status_code)
            for seen, _ in enumerate(reply.iter_lines()):
                if seen == stop:
                    break

    def disconnect(self, i: int) -> None:
        """A streamed request on a raw socket, reset (RST) once the first bytes arrive."""
        body = json.dumps({
            "model": self.model, "max_tokens": 200, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"List every ship in port, take {i}."}],
        }).encode()  # fmt: skip
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", self.server.port), timeout=120) as sock:
            sock.sendall(head + body)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                received += chunk
            status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/") else 599
            self._count("disconnect", status, received.decode(errors="replace"))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def client(self, number: int, until: float) -> None:
        """One client's session: a conversation it keeps continuing, and everything else
        in turn."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        previous: str | None = None
        steps: list[Callable[[httpx.Client, int], None]] = [
            lambda c, i: self.turn(c, messages, i),
            lambda c, i: self.stream(c, "stream", self.chat_body(number, i, True), 10**6),
            lambda c, i: self.stream(c, "cancel", self.chat_body(number, i, True, 200), 3),
            lambda c, i: self.post(c, "tools", "/v1/chat/completions", self.tools_body(i)),
            lambda c, i: self.post(c, "structured", "/v1/chat/completions", self.json_body(i)),
            lambda c, i: self.post(c, "embeddings", "/v1/embeddings", self.embed_body(i)),
            lambda c, i: self.turn(c, messages, i),
            lambda c, i: self.disconnect(number * 1000 + i),
            lambda c, i: self.post(c, "anthropic", "/v1/messages", self.anthropic_body(i)),
        ]
        with httpx.Client(timeout=120) as client:
            i = 0
            while time.monotonic() < until:
                if i % len(steps) == 4 + number % 3:  # the Responses API, chained
                    previous = self.respond(client, number, i, previous)
                steps[(i + number) % len(steps)](client, i)
                i += 1
                if len(messages) > 9:  # a new conversation once this one is long
                    del messages[1:]

    def chat_body(self, number: int, i: int, stream: bool, tokens: int = 16) -> dict[str, Any]:
        text = f"Client {number}: where does ship {i} berth?"
        return {
            "model": self.model, "max_tokens": tokens, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        }  # fmt: skip

    def turn(self, client: httpx.Client, messages: list[dict[str, Any]], i: int) -> None:
        """The conversation's next turn: its history restored from memory or disk."""
        messages.append({"role": "user", "content": f"And ship {i}?"})
        body = {"model": self.model, "max_tokens": 16, "temperature": 0, "messages": messages}
        done = self.post(client, "turn", "/v1/chat/completions", body)
        answer = done["choices"][0]["message"]["content"] if done else ""
        messages.append({"role": "assistant", "content": answer or "North."})

    def tools_body(self, i: int) -> dict[str, Any]:
        text = f"Put ship {i} at the North pier."
        return {
            "model": self.model, "max_tokens": 48, "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": text}],
        }  # fmt: skip

    def json_body(self, i: int) -> dict[str, Any]:
        return {
            "model": self.model, "max_tokens": 24,
            "messages": [{"role": "user", "content": f"Which pier for ship {i}? As JSON."}],
            "response_format": {
                "type": "json_schema", "json_schema": {"name": "pier", "schema": SCHEMA},
            },
        }  # fmt: skip

    def embed_body(self, i: int) -> dict[str, Any]:
        return {"model": self.model, "input": [f"ship {i} at North", f"{SYSTEM} {i}"]}

    def anthropic_body(self, i: int) -> dict[str, Any]:
        return {
            "model": self.model, "max_tokens": 16, "system": SYSTEM,
            "messages": [{"role": "user", "content": f"Where does ship {i} berth?"}],
        }  # fmt: skip

    def respond(self, client: httpx.Client, number: int, i: int, previous: str | None) -> Any:
        body: dict[str, Any] = {
            "model": self.model, "max_output_tokens": 16, "instructions": SYSTEM,
            "input": f"Client {number}, ship {i}: which pier?",
        }  # fmt: skip
        if previous is not None and i % 4:
            body["previous_response_id"] = previous
        done = self.post(client, "responses", "/v1/responses", body)
        return done["id"] if done else None


def watch_health(url: str, until: float, late: list[str]) -> None:
    """Ask ``/health`` every `HEALTH_EVERY_S` until ``until``; note each answer that took
    longer than `HEALTH_LIMIT_S` or was not 200."""
    with httpx.Client(timeout=HEALTH_LIMIT_S * 5) as client:
        while time.monotonic() < until:
            began = time.monotonic()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError as exc:
                late.append(f"{began:.1f}: {exc!r}")
                continue
            took = time.monotonic() - began
            if status != 200 or took > HEALTH_LIMIT_S:
                late.append(f"{began:.1f}: {status} in {took:.2f} s")
            time.sleep(HEALTH_EVERY_S)


def gauges(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("slotserve_") and not line.startswith("#") and "{" not in line
    }


def greedy(server: ServerProcess) -> str:
    body = {
        "model": server.model_name, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Where does the ferry berth?"}],
    }  # fmt: skip
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def test_everything_at_once_never_hangs_or_fails(server: ServerProcess, tmp_path: Path) -> None:
    baseline = greedy(server)
    load = Load(server)
    until = time.monotonic() + LOAD_S
    late: list[str] = []
    watcher = threading.Thread(target=watch_health, args=(server.url, until, late), daemon=True)
    clients = [
        threading.Thread(target=load.client, args=(n, until), daemon=True) for n in range(CLIENTS)
    ]
    watcher.start()
    for thread in clients:
        thread.start()
    for thread in [*clients, watcher]:
        thread.join(LOAD_S + 180)
    hung = [thread.name for thread in [*clients, watcher] if thread.is_alive()]
    assert not hung, f"clients still waiting: {hung}; health: {late[-5:]}"
    assert not late, f"/health was slow or failed: {late[:10]}"
    assert not load.failures, load.failures[:10]
    assert set(load.kinds) >= {"turn", "stream", "cancel", "tools", "structured", "embeddings"}
    assert set(load.kinds) >= {"disconnect", "anthropic", "responses"}
    # Idle again: every slot back, the pool's blocks those the snapshots pin.
    deadline = time.monotonic() + 60
    while (now := gauges(server))["slotserve_slots_in_use"] or now["slotserve_queue_length"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    block_bytes = now["slotserve_kv_pool_bytes"] / (
        now["slotserve_kv_blocks_used"] + now["slotserve_kv_blocks_free"]
    )
    assert now["slotserve_kv_blocks_used"] * block_bytes == now["slotserve_prefix_bytes_pinned"]
    assert now["slotserve_prefix_store_hits_total"] > 0, "no restore came from the disk tier"
    assert now["slotserve_prefix_store_written_total"] > 0
    hits = now["slotserve_prefix_store_hits_total"]
    print(f"statuses {dict(load.statuses)}, kinds {dict(load.kinds)}, disk restores {hits:.0f}")
    assert greedy(server) == baseline
    assert "LockOrderError" not in server.output()
    assert "Traceback" not in server.output(), server.output()[-4000:]
