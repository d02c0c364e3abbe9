"""``slotserve serve --prefix-store DIR`` end to end on the bundled model: a server killed
with SIGKILL mid-conversation and started again on the same store answers the next chat
turn with the history in ``cached_tokens``, and with the text and log-probabilities of a
server that never cached it; /metrics counts the restore and the store's bytes; a store
directory that cannot be written stops the server at start with a clear error."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import ServerProcess

FLAGS = ("--max-context", "512", "--kv-layout", "cell", "--max-seqs", "2")
SYSTEM = "You are the assistant of a small weather-station company. Answer briefly. " * 6
TURNS = ["What can the station measure?", "And how often?", "Where does the data go?"]


def chat(server: ServerProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": server.model_name, "messages": messages, "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def store_metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_kill_9_then_restart_restores_the_conversation(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    server = ServerProcess("bundled", *FLAGS, "--prefix-store", store)
    messages = [{"role": "system", "content": SYSTEM}]
    try:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            reply = chat(server, messages)
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )
        while store_metric(server, "slotserve_prefix_store_queued") > 0:
            time.sleep(0.05)  # until the writes of the last turn are on disk
        assert store_metric(server, "slotserve_prefix_store_files") >= 1
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
    messages.append({"role": "user", "content": "Thanks. How do I charge it?"})
    restarted = ServerProcess("bundled", *FLAGS, "--prefix-store", store)
    try:
        assert "prefix store" in restarted.output()  # indexed, with its bytes, at start
        warm = chat(restarted, messages)
        assert store_metric(restarted, "slotserve_prefix_store_hits_total") == 1
        assert (
            store_metric(restarted, 'slotserve_prefix_store_refused_total{reason="checksum"}') == 0
        )
    finally:
        assert restarted.stop() == 0
    cold_server = ServerProcess("bundled", *FLAGS, "--no-prefix-cache")
    try:
        cold = chat(cold_server, messages)
    finally:
        assert cold_server.stop() == 0
    usage = warm["usage"]
    history = usage["prompt_tokens"] - 20  # the last user turn and its template: < 20 tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= history
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]  # exact floats


def test_an_unwritable_store_stops_the_server_at_start(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    command = [sys.executable, "-m", "slotserve.cli", "serve", "--model", "bundled", *FLAGS]
    result = subprocess.run(
        [*command, "--prefix-store", str(a_file / "store")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "pass a writable directory to --prefix-store" in result.stderr
