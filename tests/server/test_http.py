"""HTTP behaviour a client relies on: disconnect cancels, refusals as statuses, security,
health/metrics/slots, tokenize, graceful shutdown."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess

AUTH = {"Authorization": "Bearer sekret"}


def slots_busy(server: ServerProcess) -> int:
    slots = httpx.get(server.url + "/slots", headers=AUTH).json()
    return sum(s["state"] != "idle" for s in slots)


def wait_idle(server: ServerProcess, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while slots_busy(server):
        assert time.monotonic() - start < timeout, "slots still busy"
        time.sleep(0.01)
    return time.monotonic() - start


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def bundled_server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "bundled",
        "--max-seqs",
        "2",
        "--queue-depth",
        "0",
        "--max-context",
        "512",
        "--api-key",
        "sekret",
    )
    yield server
    assert server.stop() == 0  # SIGTERM: graceful, exit status 0
    assert "Traceback" not in server.output(), server.output()


def long_stream(server: ServerProcess, client: httpx.Client) -> httpx.Response:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "stream": True,
        "temperature": 0.8,
        "seed": 1,
        "ignore_eos": True,
    }
    request = client.build_request("POST", server.url + "/v1/completions", json=body, headers=AUTH)
    return client.send(request, stream=True)


def test_disconnect_frees_the_slot(bundled_server: ServerProcess) -> None:
    before = metric(bundled_server, "slotserve_cancellations_total")
    with httpx.Client(timeout=30) as client:
        response = long_stream(bundled_server, client)
        lines = response.iter_lines()
        chunks = []
        for line in lines:
            if line.startswith("data:"):
                chunks.append(line)
            if len(chunks) == 2:
                break
        assert slots_busy(bundled_server) == 1
        response.close()
    waited = wait_idle(bundled_server)
    assert waited < 2.0  # one step of the bundled model is ~0.1 s; allow scheduling noise
    assert metric(bundled_server, "slotserve_cancellations_total") == before + 1
    assert metric(bundled_server, "slotserve_cancel_release_seconds_count") >= 1


def test_third_stream_is_429_then_served(bundled_server: ServerProcess) -> None:
    with httpx.Client(timeout=30) as client:
        first, second = long_stream(bundled_server, client), long_stream(bundled_server, client)
        # Keep the line iterators alive: an abandoned httpx iterator closes its response.
        readers = [response.iter_lines() for response in (first, second)]
        for response, reader in zip((first, second), readers, strict=True):
            assert response.status_code == 200
            next(line for line in reader if line.startswith("data:"))
        assert slots_busy(bundled_server) == 2
        third = client.post(
            bundled_server.url + "/v1/completions",
            headers=AUTH,
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4},
        )
        assert third.status_code == 429
        assert third.headers["Retry-After"] == "1"
        error = third.json()["error"]
        assert error["code"] == "slots_full" and "2 slots" in error["message"]
        first.close()
        wait_until_slots(bundled_server, 1)
        fourth = client.post(
            bundled_server.url + "/v1/completions",
            headers=AUTH,
            json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4},
        )
        assert fourth.status_code == 200
        second.close()
    wait_idle(bundled_server)
    assert metric(bundled_server, 'slotserve_admissions_refused_total{reason="slots_full"}') >= 1


def wait_until_slots(server: ServerProcess, busy: int) -> None:
    deadline = time.monotonic() + 5
    while slots_busy(server) != busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_api_key(bundled_server: ServerProcess) -> None:
    url = bundled_server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    card = httpx.get(url, headers=AUTH)
    assert card.status_code == 200
    # load() picked the fused block halves for the bundled Q4_1 file, and says so
    assert card.json()["data"][0]["slotserve"] == {
        "halves": "block",
        "kernels": "attention, blocks",
    }
    assert httpx.get(bundled_server.url + "/health").status_code == 200  # not under /v1


def test_errors_are_openai_shaped_and_never_500(tiny_server: ServerProcess) -> None:
    url = tiny_server.url + "/v1/chat/completions"
    cases = [
        b"{not json",
        b"[]",
        json.dumps({"model": tiny_server.model_name}).encode(),
        json.dumps({"model": tiny_server.model_name, "messages": [{"role": "wizard"}]}).encode(),
        json.dumps(
            {
                "model": tiny_server.model_name,
                "messages": [{"role": "user", "content": "x"}],
                "stop": ["a", "b", "c", "d", "e"],
            }
        ).encode(),
        json.dumps({"model": 3, "messages": []}).encode(),
    ]
    for body in cases:
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in response.text


def test_body_size_limit(tiny_server: ServerProcess) -> None:
    big = {"model": tiny_server.model_name, "prompt": "x" * (2 << 20)}
    response = httpx.post(tiny_server.url + "/v1/completions", json=big)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


def test_health_metrics_slots(tiny_server: ServerProcess) -> None:
    assert httpx.get(tiny_server.url + "/health").json()["status"] == "ok"
    response = httpx.get(tiny_server.url + "/slots")
    slots = response.json()
    assert len(slots) == 4 and all(s["state"] == "idle" for s in slots)
    # The cancellation bound in seconds from the start: serve times its largest step
    # (4 sessions x 128 tokens at max_context) before it listens.
    assert response.headers["x-cancel-bound-basis"] == "measured"
    assert float(response.headers["x-cancel-bound-seconds"]) > 0
    log = tiny_server.output()
    measured = log.index("worst-case cancel→release: ")
    assert measured < log.index("serving ") and "(a 512-token step, measured)" in log
    text = httpx.get(tiny_server.url + "/metrics").text
    for name in (
        "slotserve_time_to_first_token_seconds",
        "slotserve_inter_token_latency_seconds",
        "slotserve_queue_time_seconds",
        "slotserve_request_duration_seconds",
        "slotserve_prompt_tokens_total",
        "slotserve_generated_tokens_total",
        "slotserve_slots_in_use",
        "slotserve_kv_blocks_used",
        "slotserve_kv_blocks_free",
        "slotserve_cancellations_total",
        "slotserve_cancel_release_seconds",
    ):
        assert name in text, name


def test_tokenize_round_trip(tiny_server: ServerProcess) -> None:
    tokens = httpx.post(tiny_server.url + "/tokenize", json={"text": "héllo"}).json()["tokens"]
    text = httpx.post(tiny_server.url + "/detokenize", json={"tokens": tokens}).json()["text"]
    assert text == "héllo"
    chat = httpx.post(
        tiny_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] == len(chat["tokens"]) > 2
    bad = httpx.post(tiny_server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_tokenize_bad_content_is_400(tiny_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    response = httpx.post(tiny_server.url + "/tokenize", json=body)
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_streamed_body_over_the_limit_is_413(tiny_server: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(64):
            yield b"x" * (32 << 10)
        yield b'"}'

    response = httpx.post(
        tiny_server.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413


def test_slots_and_tokenize_need_the_key(bundled_server: ServerProcess) -> None:
    assert httpx.get(bundled_server.url + "/slots").status_code == 401
    assert httpx.get(bundled_server.url + "/slots", headers=AUTH).status_code == 200
    assert httpx.post(bundled_server.url + "/tokenize", json={"text": "a"}).status_code == 401


def test_prefix_cache_metrics(tiny_dirs: dict[str, Path]) -> None:
    server = ServerProcess(
        str(tiny_dirs["llama"]),
        "--kv-layout",
        "cell",
        "--block-size",
        "8",
        "--max-context",
        "256",
        "--prefix-cache",
        "1MiB",
    )
    try:
        system = "You are terse. " * 4
        for question in ("a?", "b?", "c?"):
            body = {"model": server.model_name, "prompt": system + question, "max_tokens": 2}
            assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
        assert metric(server, "slotserve_prefix_hits_total") == 2
        assert metric(server, "slotserve_prefix_misses_total") == 1
        assert metric(server, "slotserve_prefix_tokens_restored_total") >= 2 * len(system)
        assert metric(server, "slotserve_prefix_bytes_pinned") > 0
        assert metric(server, "slotserve_prefix_budget_bytes") == 1 << 20
        assert metric(server, "slotserve_prefix_snapshots") >= 1
        text = httpx.get(server.url + "/metrics").text
        for name in ("slotserve_prefix_evictions_total", "slotserve_prefix_rejections"):
            assert name in text, name
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()
