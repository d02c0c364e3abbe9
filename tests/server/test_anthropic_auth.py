"""A missing or wrong API key on Anthropic's routes is answered in that API's error shape
(issue 28): 401 ``{"type": "error", "error": {"type": "authentication_error", …}}``, which
the official ``anthropic`` client raises as `anthropic.AuthenticationError`; OpenAI's
routes keep OpenAI's shape. The key is still checked from the request head, before the
body. In-process: the app around a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.server import create_app

NAME = "tiny"
KEY = "sekret"
MESSAGE = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def app_client(tiny_dirs: dict[str, Path]) -> Iterator[TestClient]:
    engine = ss.Engine(ss.load(tiny_dirs["llama"]), ss.EngineConfig(max_seqs=2, max_context=128))
    with TestClient(create_app(engine, NAME, api_key=KEY)) as client:
        yield client
    engine.close()


@pytest.mark.parametrize(
    "path", ["/v1/messages", "/v1/messages/count_tokens", "/messages", "/messages/count_tokens"]
)
@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"Authorization": "Bearer no"}])
def test_refused_key_is_anthropics_authentication_error(
    app_client: TestClient, path: str, headers: dict[str, str]
) -> None:
    response = app_client.post(path, json=MESSAGE, headers=headers)
    assert response.status_code == 401, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    assert "API key" in body["error"]["message"]
    assert set(body) == {"type", "error"}


def test_refused_key_before_the_body_is_read(app_client: TestClient) -> None:
    response = app_client.post("/v1/messages", content=b"{not json", headers={"x-api-key": "no"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers.get("connection") == "close"  # the body announced is never read


def test_the_right_key_is_served(app_client: TestClient) -> None:
    response = app_client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": KEY})
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


def test_the_official_client_raises_authentication_error(app_client: TestClient) -> None:
    client = anthropic.Anthropic(
        base_url=str(app_client.base_url), api_key="wrong", http_client=app_client, max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client.messages.create(**MESSAGE)  # type: ignore[call-overload]
    assert raised.value.status_code == 401
    assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_openai_routes_keep_openais_shape(app_client: TestClient) -> None:
    body = {"model": NAME, "messages": MESSAGE["messages"]}
    response = app_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
