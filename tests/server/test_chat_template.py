"""A model without a chat template: chat requests get 400 naming the missing template and
the fix (``--chat-template FILE``), plain prompts still work; and ``slotserve serve
--chat-template FILE`` renders chats with the file's template. A model whose template does
not parse loads and is served the same way: every chat route answers 400 naming the file,
the line and jinja2's message (never 500), and ``--chat-template FILE`` mends it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.cli import main
from slotserve.server import create_app
from tests.server.conftest import ServerProcess

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"


@pytest.fixture(scope="module")
def client(tiny_dirs: dict[str, Path]) -> Iterator[TestClient]:
    model = ss.load(tiny_dirs["llama"])  # its own copy: the shared tiny model keeps its template
    model.tokenizer.chat_template = None
    engine = ss.Engine(model, ss.EngineConfig(max_seqs=2, max_context=128))
    yield TestClient(create_app(engine, NAME))
    engine.close()


def assert_names_the_fix(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "chat_template_missing"
    assert error["type"] == "invalid_request_error"
    assert "no chat template" in error["message"]
    assert "--chat-template FILE" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_a_template_is_400(client: TestClient, stream: bool) -> None:
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, "stream": stream}
    assert_names_the_fix(client.post("/v1/chat/completions", json=body))


def test_tokenize_messages_without_a_template_is_400(client: TestClient) -> None:
    assert_names_the_fix(client.post("/tokenize", json={"messages": MESSAGES}))


def test_plain_prompts_still_work(client: TestClient) -> None:
    body = {"model": NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_serve_renders_chats_with_the_chat_template_file(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ("--max-context", "256", "--chat-template", str(template))
    server = ServerProcess(str(tiny_dirs["llama"]), *flags)
    try:
        tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": server.model_name, "messages": MESSAGES, "max_tokens": 2},
        )
    finally:
        assert server.stop() == 0
    tokenizer = ss.load(tiny_dirs["llama"]).tokenizer
    assert tokens["tokens"] == tokenizer.encode("[user: hi]")
    assert reply.status_code == 200, reply.text


def test_an_unreadable_chat_template_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jinja"
    assert main(["serve", "--model", "no-such-model", "--chat-template", str(missing)]) != 0
    assert f"--chat-template {missing}: cannot read it" in capsys.readouterr().err


BROKEN = "{% for m in messages %}\n{% if %}{% endif %}{% endfor %}"  # line 2 does not parse


@pytest.fixture(scope="module")
def broken_dir(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that does not parse."""
    directory = tmp_path_factory.mktemp("broken") / "tiny"
    shutil.copytree(tiny_dirs["llama"], directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": BROKEN}))
    return directory


def test_a_template_that_does_not_parse_is_400_on_every_chat_route(broken_dir: Path) -> None:
    server = ServerProcess(str(broken_dir), "--max-context", "256")
    name = server.model_name
    chat = {"model": name, "messages": MESSAGES, "max_tokens": 2}
    try:
        answers = {
            "chat": httpx.post(server.url + "/v1/chat/completions", json=chat),
            "chat stream": httpx.post(
                server.url + "/v1/chat/completions", json={**chat, "stream": True}
            ),
            "tokenize": httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}),
            "responses": httpx.post(
                server.url + "/v1/responses", json={"model": name, "input": "hi"}
            ),
            "anthropic": httpx.post(server.url + "/v1/messages", json=chat),
        }
        completion = httpx.post(
            server.url + "/v1/completions",
            json={"model": name, "prompt": "hello", "max_tokens": 2},
        )
    finally:
        assert server.stop() == 0
    source = f"{broken_dir / 'tokenizer_config.json'} [chat_template]"
    for route, answer in answers.items():
        assert answer.status_code == 400, (route, answer.text)
        message = json.dumps(answer.json())
        assert "chat template does not parse (line 2: Expected an expression" in message, route
        assert source in message and "--chat-template FILE" in message, route
    assert answers["chat"].json()["error"]["code"] == "chat_template_missing"
    assert completion.status_code == 200, completion.text  # plain prompts still work
    output = server.output()
    assert "Traceback" not in output, output
    assert f"{source}: the chat template does not parse" in output  # said once, at load


def test_chat_template_file_mends_a_template_that_does_not_parse(
    broken_dir: Path, tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(
        str(broken_dir), "--max-context", "256", "--chat-template", str(template)
    )
    try:
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": server.model_name, "messages": MESSAGES, "max_tokens": 2},
        )
    finally:
        assert server.stop() == 0
    assert reply.status_code == 200, reply.text


def test_a_chat_template_file_that_does_not_parse_is_400(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}\n{% if %}")
    server = ServerProcess(
        str(tiny_dirs["llama"]), "--max-context", "256", "--chat-template", str(template)
    )
    try:
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": server.model_name, "messages": MESSAGES, "max_tokens": 2},
        )
    finally:
        assert server.stop() == 0
    assert reply.status_code == 400, reply.text
    assert "does not parse (line 2: " in reply.json()["error"]["message"]
