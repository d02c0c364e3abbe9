"""Server options a deployment sets: sampling defaults (flags, generation_config.json),
the default queue, CORS, X-Api-Key and --metrics-key; against a real server process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slotserve.server.chat.defaults import SamplingDefaults, defaults_for
from slotserve.server.openai.completions import sampling_params
from slotserve.server.openai.schemas import ChatCompletionRequest
from tests.server.conftest import ServerProcess

KEY, METRICS_KEY = "sekret", "scrape"
ORIGINS = ("http://a.example", "http://b.example")


@pytest.fixture(scope="module")
def server(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    flags = ["--max-seqs", "2", "--max-context", "256", "--api-key", KEY]
    flags += ["--metrics-key", METRICS_KEY, "--temperature", "0.3", "--top-k", "7"]
    for origin in ORIGINS:
        flags += ["--cors-origin", origin]
    # No --queue-depth: the server's default queue.
    server = ServerProcess(str(tiny_dirs["llama"]), *flags)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def test_startup_log_names_the_defaults(server: ServerProcess) -> None:
    log = server.output()
    assert "sampling defaults: temperature 0.3, top_p 0.95, top_k 7, min_p 0.05" in log


def test_x_api_key_header(server: ServerProcess) -> None:
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"X-Api-Key": "nope"}).status_code == 401
    assert httpx.get(url, headers={"X-Api-Key": KEY}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_key(server: ServerProcess) -> None:
    url = server.url + "/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    scraped = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert scraped.status_code == 200 and "slotserve_slots_in_use" in scraped.text


def test_cors_preflight_and_response(server: ServerProcess) -> None:
    url = server.url + "/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key"}
    for origin in ORIGINS:
        preflight = httpx.options(url, headers={"Origin": origin, **ask})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
    stranger = httpx.options(url, headers={"Origin": "http://evil.example", **ask})
    assert "access-control-allow-origin" not in stranger.headers
    # The real request (even a refused one) carries the header, so a page can read it.
    refused = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGINS[0]})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGINS[0]


def test_requests_queue_by_default(server: ServerProcess, tiny_dirs: dict[str, Path]) -> None:
    """Six clients on two slots: the four that find no slot wait, none is refused."""
    body = {
        "model": tiny_dirs["llama"].name,  # the served name: the directory name
        "prompt": "abc",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    statuses: list[int] = []

    def one() -> None:
        response = httpx.post(
            server.url + "/v1/completions", json=body, headers={"X-Api-Key": KEY}, timeout=60
        )
        statuses.append(response.status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 6


def test_queue_depth_zero_refuses_at_once(tiny_dirs: dict[str, Path]) -> None:
    from slotserve.cli import build_parser
    from slotserve.cli.flags import engine_config
    from slotserve.cli.serve import with_server_queue

    def depth(*flags: str) -> int:
        args = build_parser().parse_args(["serve", "--max-seqs", "3", *flags])
        return with_server_queue(engine_config(args), args).queue_depth

    assert depth() == 12
    assert depth("--queue-depth", "0") == 0
    assert depth("--queue-depth", "5") == 5


def test_request_fields_override_defaults() -> None:
    defaults = SamplingDefaults().overridden(temperature=0.5)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}
    )
    params = sampling_params(body, 100, 0, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.5, 3, 0.95, 0.05)
    openai_default = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
    )
    assert sampling_params(openai_default, 100, 0, defaults).temperature == 1.0


def test_generation_config_supplies_defaults(tmp_path: Path) -> None:
    assert defaults_for("bundled") == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert defaults_for(str(tmp_path)) == SamplingDefaults()  # no sampling field in it
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    found = defaults_for(str(tmp_path))
    assert (found.temperature, found.top_p, found.top_k, found.min_p) == (0.6, 0.9, 20, 0.05)
    assert "generation_config.json" in found.source
    assert found.overridden(top_k=5).top_k == 5
    with pytest.raises(ValueError, match="temperature"):
        SamplingDefaults(temperature=3.0)
