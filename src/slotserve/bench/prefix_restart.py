"""``bench prefix``'s server-level restart: ``slotserve serve --prefix-store`` killed with
SIGKILL after a conversation and started again on its store, against a cold server.

Each repeat: a one-slot cell server with the store holds a conversation of 4 chat turns
after a long system prompt; once its writes are on disk the store directory is copied aside
(the files a ``kill -9`` now would leave) and the server answers turn 5 (never restarted:
memory restores the history). It is killed with SIGKILL. Then a server started on the
copied store (restored from disk) and a server without a store (cold: the whole history
computed) each answer the same turn 5 as their first request, taking turns going first
across repeats. TTFT is the client's: from sending the streamed request to its first
content chunk; the restored tokens are the response's ``cached_tokens``.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from slotserve.bench.processes import ServerProcess, slotserve_server
from slotserve.bench.stats import summary

TURNS = ("What does it measure?", "How often?", "Sent where?", "Exported how?", "Its cost?")
REPLY_TOKENS = 16
HISTORY_TURNS = len(TURNS) - 1
TIMEOUT_S = 300.0


def _flags(context: int, cache_bytes: int, store: Path | None) -> list[str]:
    """Every server the same pool and prefix cache (on, also where the model's default is
    off), the store only where it is given."""
    flags = ["--max-seqs", "1", "--max-context", str(context), "--kv-layout", "cell"]
    flags += ["--prefix-cache", str(cache_bytes)]
    return [*flags, "--prefix-store", str(store)] if store else flags


def _reply(server: ServerProcess, messages: list[dict[str, str]]) -> str:
    body = {
        "model": server.model_name, "messages": messages, "max_tokens": REPLY_TOKENS,
        "temperature": 0,
    }  # fmt: skip
    response = server.http.post("/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"the server answered {response.status_code}: {response.text}")
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def _first_token(server: ServerProcess, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Turn 5, streamed: the client's TTFT, and the usage's prompt and cached tokens."""
    body = {
        "model": server.model_name, "messages": messages, "max_tokens": REPLY_TOKENS,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    client = server.http  # made before the clock starts
    began, ttft, usage = time.perf_counter(), None, None
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - began
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage is not None, "no content or no usage was streamed"
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "prompt": usage["prompt_tokens"],
        "cached": details.get("cached_tokens", 0),
    }


def _queued(server: ServerProcess) -> float:
    for line in server.http.get("/metrics", timeout=10).text.splitlines():
        if line.startswith("slotserve_prefix_store_queued "):
            return float(line.split()[1])
    raise RuntimeError("slotserve_prefix_store_queued is not in /metrics")


def _repeat(spec: str, system: str, context: int, cache: int, first_cold: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-restart-") as where:
        live, copy = Path(where) / "live", Path(where) / "restart"
        server = slotserve_server(spec, *_flags(context, cache, live))
        try:
            messages = [{"role": "system", "content": system}]
            for user in TURNS[:HISTORY_TURNS]:
                messages.append({"role": "user", "content": user})
                messages.append({"role": "assistant", "content": _reply(server, messages)})
            messages.append({"role": "user", "content": TURNS[HISTORY_TURNS]})
            while _queued(server) > 0:
                time.sleep(0.05)  # until the last turn's snapshot is on disk
            shutil.copytree(live, copy)
            sides = {"never_restarted": _first_token(server, messages)}
        finally:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)
            server.http.close()
        for side in ("cold", "restored") if first_cold else ("restored", "cold"):
            store = copy if side == "restored" else None
            fresh = slotserve_server(spec, *_flags(context, cache, store))
            try:
                sides[side] = _first_token(fresh, messages)
            finally:
                fresh.stop()
    return sides


def run_restart_server(
    spec: str, system: str, context: int, cache_bytes: int, repeats: int, warm_up: bool = True
) -> dict[str, Any]:
    """Turn 5 on a server killed and restarted on its store, beside a cold server, over
    ``repeats`` (after a warm-up repeat on a shorter history, not counted); every server
    has a one-slot cell pool of ``context`` tokens and a prefix cache of ``cache_bytes``."""
    if warm_up:
        _repeat(spec, system[: len(system) // 4], context, cache_bytes, True)
    runs = [_repeat(spec, system, context, cache_bytes, i % 2 == 0) for i in range(repeats)]
    sides = ("never_restarted", "restored", "cold")
    return {
        "history_tokens": runs[-1]["cold"]["prompt"],
        "context": context,
        **{f"ttft_s_{side}": summary([r[side]["ttft_s"] for r in runs]) for side in sides},
        **{f"cached_{side}": min(r[side]["cached"] for r in runs) for side in sides},
        "ratio_cold_over_restored": summary(
            [r["cold"]["ttft_s"] / r["restored"]["ttft_s"] for r in runs]
        ),
    }
