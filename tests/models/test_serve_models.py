"""Several models in one real `slotserve serve` process: routing by the request's model
field, concurrent answers from two models, and on-demand models loaded on first use and
unloaded when another needs the room, with the process's anonymous memory sampled through
a load and an unload against the budget, and a load without room refused with
``model_capacity`` (nothing half-loaded left)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.bench.processes import ServerProcess as BenchServerProcess
from slotserve.bench.processes import free_port
from slotserve.memory import read_process
from tests.server.conftest import ServerProcess


def chat(url: str, model: str, content: str = "Hello", max_tokens: int = 4) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def cards(url: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {card["id"]: card for card in data}


@pytest.fixture(scope="module")
def two_models(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    """A chat model named ``chat`` and a second one under its own id (its directory's name)."""
    server = ServerProcess(
        f"chat={tiny_dirs['llama']}",
        "--model", str(tiny_dirs["qwen2"]), "--max-seqs", "2", "--max-context", "128",
    )  # fmt: skip
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def test_each_model_answers_under_its_name_concurrently(two_models: ServerProcess) -> None:
    url = two_models.url
    jobs = ["chat", "qwen2"] * 4
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda m: chat(url, m, max_tokens=8), jobs))
    for model, reply in zip(jobs, replies, strict=True):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == model
        assert body["usage"]["completion_tokens"] >= 1
    # the two models are different models: the same greedy prompt differs
    texts = {
        m: r.json()["choices"][0]["message"]["content"] for m, r in zip(jobs, replies, strict=True)
    }
    assert texts["chat"] != texts["qwen2"]


def test_every_api_routes_by_model(two_models: ServerProcess) -> None:
    url = two_models.url
    text = httpx.post(
        url + "/v1/completions",
        json={"model": "qwen2", "prompt": "ab", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert text.status_code == 200 and text.json()["model"] == "qwen2", text.text
    message = httpx.post(
        url + "/v1/messages",
        json={"model": "qwen2", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert message.status_code == 200 and message.json()["model"] == "qwen2", message.text
    response = httpx.post(
        url + "/v1/responses",
        json={"model": "chat", "input": "hi", "max_output_tokens": 3},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["model"] == "chat", response.text
    embedded = httpx.post(
        url + "/v1/embeddings", json={"model": "qwen2", "input": ["a", "bc"]}, timeout=60
    )
    assert embedded.status_code == 200 and embedded.json()["model"] == "qwen2", embedded.text
    assert len(embedded.json()["data"]) == 2


def test_unknown_model_is_404_naming_the_served_ones(two_models: ServerProcess) -> None:
    reply = chat(two_models.url, "nope")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'chat'" in error["message"] and "'qwen2'" in error["message"]
    anthropic = httpx.post(
        two_models.url + "/v1/messages",
        json={"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"


def test_models_lists_state_bytes_and_kind(two_models: ServerProcess) -> None:
    listed = cards(two_models.url)
    assert set(listed) == {"chat", "qwen2"}
    for card in listed.values():
        own = card["slotserve"]
        assert own["state"] == "loaded" and own["kind"] == "generate" and own["resident"]
        assert own["bytes"] > 0
    single = httpx.get(two_models.url + "/v1/models/qwen2", timeout=30).json()
    assert single["id"] == "qwen2" and single["slotserve"]["state"] == "loaded"


# -- on demand, under a budget -------------------------------------------------------------

MODELS_TOML = """
[models.chat]
source = "{chat}"
max_seqs = 2
max_context = 128

[models.a]
source = "bundled"
resident = false
max_seqs = 1
max_context = 256

[models.b]
source = "bundled"
resident = false
max_seqs = 1
max_context = 256
"""


def plan_of(models_file: Path) -> dict[str, Any]:
    """``slotserve plan --models FILE --json``: the device plan serve makes of the set."""
    command = [sys.executable, "-m", "slotserve.cli", "plan", "--models", str(models_file)]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


class AnonymousSampler:
    """The server process's anonymous bytes, read every few milliseconds on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples = pid, [read_process(pid).anonymous]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(read_process(self.pid).anonymous)
            time.sleep(0.005)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.samples


def wait_idle(url: str, model: str, timeout_s: float = 60) -> None:
    """Until ``model`` holds no lease and runs no request (a closed stream's request is
    cancelled at its next step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        own = cards(url)[model]["slotserve"]
        if own["leases"] == 0 and not own["busy"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"{model} stayed leased")


def test_on_demand_models_load_unload_and_refuse_within_the_budget(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    models_file = tmp_path / "models.toml"
    models_file.write_text(MODELS_TOML.format(chat=tiny_dirs["llama"]))
    plan = plan_of(models_file)
    sizes = {card["id"]: card["bytes"] for card in plan["models"]}
    assert plan["fits"] and sizes["a"] > 0 and sizes["b"] > 0
    # Room for the resident model and one of the on-demand ones, never both of them.
    budget = plan["shared_bytes"] + sizes["chat"] + max(sizes["a"], sizes["b"]) * 3 // 2
    assert budget < plan["shared_bytes"] + sizes["chat"] + sizes["a"] + sizes["b"]
    port = free_port()
    command = [sys.executable, "-m", "slotserve.cli", "serve", "--models", str(models_file)]
    command += ["--port", str(port), "--memory-budget", str(budget), "--log-level", "info"]
    server = BenchServerProcess(command, port)
    try:
        url = server.url
        listed = cards(url)
        assert [listed[m]["slotserve"]["state"] for m in ("chat", "a", "b")] == [
            "loaded", "unloaded", "unloaded",
        ]  # fmt: skip
        sampler = AnonymousSampler(server.process.pid)
        idle = read_process(server.process.pid).anonymous

        # First use of a: loaded on demand, then answers.
        assert chat(url, "a").status_code == 200
        assert cards(url)["a"]["slotserve"]["state"] == "loaded"
        with_a = read_process(server.process.pid).anonymous
        assert with_a > idle + sizes["a"] // 4  # its weights are really there

        # b while a has a request in flight: no room without unloading a, which is busy:
        # refused at admission, nothing of b loaded, a and chat untouched.
        body = {
            "model": "a", "messages": [{"role": "user", "content": "Count to a hundred."}],
            "max_tokens": 200, "temperature": 0, "stream": True,
        }  # fmt: skip
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as stream:
            lines = stream.iter_lines()
            assert any(line.startswith("data: {") for line in lines)  # a is decoding now
            refused = chat(url, "b")
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "model_capacity"
            assert refused.headers["Retry-After"]
            assert "'b'" in refused.json()["error"]["message"]
            listed = cards(url)
            assert listed["b"]["slotserve"]["state"] == "unloaded"
            assert listed["b"]["slotserve"]["loads"] == 0
            assert listed["a"]["slotserve"]["state"] == "loaded"
            assert chat(url, "chat").status_code == 200  # the resident model still answers
        wait_idle(url, "a")

        # b again, a now idle: a is unloaded (least recently used), then b loads.
        assert chat(url, "b").status_code == 200
        listed = cards(url)
        assert listed["a"]["slotserve"]["state"] == "unloaded"
        assert listed["a"]["slotserve"]["unloads"] == 1
        assert listed["b"]["slotserve"]["state"] == "loaded"
        with_b = read_process(server.process.pid).anonymous
        samples = sampler.stop()
        # The measured anonymous memory never passed the budget, through the load of a,
        # its unload and the load of b; and a's memory went back: the two bundled models
        # were never resident together.
        assert max(samples) <= budget, (max(samples), budget)
        assert max(samples) < with_a + sizes["b"] // 2, (max(samples), with_a)
        assert with_b < with_a + sizes["b"] // 4, (with_b, with_a)
        assert "Traceback" not in server.output(), server.output()
        assert "loading model b" in server.output() and "unloading model a" in server.output()
    finally:
        assert server.stop() == 0


# -- a chat model and an encoder ------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_and_minilm(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    """The tiny chat model as ``chat`` and all-MiniLM-L6-v2 as ``embed``, one process."""
    server = ServerProcess(
        f"chat={tiny_dirs['llama']}", "--model", "embed=minilm",
        "--max-seqs", "2", "--max-context", "128",
    )  # fmt: skip
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def test_chat_and_embeddings_answer_concurrently(chat_and_minilm: ServerProcess) -> None:
    import torch

    from slotserve.artifact.encoder import load_encoder

    url = chat_and_minilm.url
    texts = ["the cat sat on the mat", "a note about groceries " * 40, "hi"]

    def embeddings() -> httpx.Response:
        return httpx.post(
            url + "/v1/embeddings", json={"model": "embed", "input": texts}, timeout=300
        )

    with ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat, url, "chat", "Hello", 8) for _ in range(3)]
        embeds = [pool.submit(embeddings) for _ in range(3)]
        for future in chats:
            reply = future.result()
            assert reply.status_code == 200 and reply.json()["model"] == "chat", reply.text
        vectors = []
        for future in embeds:
            reply = future.result()
            assert reply.status_code == 200 and reply.json()["model"] == "embed", reply.text
            vectors.append([row["embedding"] for row in reply.json()["data"]])
    # Each reply is the encoder's own embeddings of the texts (batched with others or not).
    encoder = load_encoder("minilm")
    expected = encoder.embed(encoder.tokenize(texts))
    for got in vectors:
        assert torch.allclose(torch.tensor(got), expected, atol=1e-5)
    listed = cards(url)
    assert listed["embed"]["slotserve"]["kind"] == "embed"
    assert listed["chat"]["slotserve"]["kind"] == "generate"
    refused = chat(url, "embed")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_a_set_without_a_resident_chat_model_is_refused_before_loading() -> None:
    # The server's own routes run on a generating engine; an encoder alone was an
    # AttributeError once the server started.
    command = [sys.executable, "-m", "slotserve.cli", "serve", "--model", "embed=minilm"]
    done = subprocess.run(
        [*command, "--port", str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "needs a resident chat (generating) model" in done.stderr
    assert "loading model" not in done.stderr
