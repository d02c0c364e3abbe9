"""A chat client that sends its conversation again, turn after turn, gets the history
restored from the server's prefix cache: the next turn's usage reports the earlier turn's
prompt and reply as cached tokens."""

from __future__ import annotations

import httpx

from tests.server.conftest import ServerProcess


def test_next_chat_turn_restores_the_conversation() -> None:
    # The bundled model: its replies are text that tokenises back to the same tokens.
    server = ServerProcess(
        "bundled",
        *("--max-context", "256", "--kv-layout", "cell", "--prefix-cache", "4MiB"),
    )
    try:
        messages = [{"role": "user", "content": "tell me something"}]
        body = {"model": server.model_name, "max_tokens": 8, "temperature": 0}
        first = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60
        ).json()
        reply = first["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "and more"},
        ]
        second = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60
        ).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # More than the first prompt alone: the reply the first turn generated was kept too.
        assert cached > first["usage"]["prompt_tokens"], (first["usage"], second["usage"])
        assert cached < second["usage"]["prompt_tokens"]
    finally:
        assert server.stop() == 0
