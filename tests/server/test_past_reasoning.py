"""Issue 53, item 2: an assistant turn's past thinking reaches the chat template as
``reasoning_content`` (as llama.cpp's server passes it) from all three APIs: chat's
``reasoning_content`` (or vLLM's ``reasoning``), Anthropic's ``thinking`` blocks, and the
Responses API's reasoning items (sent back, or stored with ``previous_response_id``). A
template that renders past reasoning (Qwen3's does, inside a tool loop) then gets the
prompt llama-server builds, and the prompt's token count (``count_tokens``, ``usage``)
counts it. The official clients, against a real server on the tiny model with a
Qwen3-shaped template."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess, strict_client
from tests.server.test_tool_calling import serve, write_long_tiny

# Qwen3's rule, shortened: an assistant turn renders its reasoning_content in <think> tags.
TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" and message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or "" }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
THOUGHT = "the user greets me; greet back"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("past_reasoning")
    template = root / "qwen3ish.jinja"
    template.write_text(TEMPLATE)
    process = serve(write_long_tiny(root), "--chat-template", str(template))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with strict_client(server) as client:
        yield client


def history(**assistant: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", **assistant},
        {"role": "user", "content": "how are you?"},
    ]


def rendered(server: ServerProcess, messages: list[dict[str, Any]]) -> str:
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text: str = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["text"]
    return text


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_chat_reasoning_reaches_the_template(
    client: openai.OpenAI, server: ServerProcess, field: str
) -> None:
    assert f"<think>\n{THOUGHT}\n</think>" in rendered(server, history(**{field: THOUGHT}))
    plain = client.chat.completions.create(
        model=server.model_name,
        messages=history(),
        max_tokens=1,  # type: ignore[arg-type]
    )
    thought = client.chat.completions.create(
        model=server.model_name,
        messages=history(**{field: THOUGHT}),  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert plain.usage is not None and thought.usage is not None
    assert thought.usage.prompt_tokens > plain.usage.prompt_tokens


def test_anthropic_thinking_blocks_are_counted(server: ServerProcess) -> None:
    anthropic = pytest.importorskip("anthropic")
    blocks: list[Any] = [
        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
        {"type": "text", "text": "hello"},
    ]
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:

        def count(content: Any) -> int:
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "how are you?"},
            ]
            result = client.messages.count_tokens(model=server.model_name, messages=messages)
            return int(result.input_tokens)

        with_thinking, without = count(blocks), count(blocks[1:])
    expected = len(f"<think>\n{THOUGHT}\n</think>\n\n".encode())  # a byte a token
    assert with_thinking - without == expected


def test_responses_reasoning_items_reach_the_template(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    reasoning: dict[str, Any] = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": THOUGHT}],
    }
    said: dict[str, Any] = {"type": "message", "role": "assistant", "content": "hello"}
    asked: list[Any] = [{"role": "user", "content": "hi"}]
    then: list[Any] = [{"role": "user", "content": "how are you?"}]

    def input_tokens(items: list[Any]) -> int:
        response = client.responses.create(
            model=server.model_name, input=items, max_output_tokens=1
        )
        assert response.usage is not None
        return response.usage.input_tokens

    without = input_tokens([*asked, said, *then])
    with_thinking = input_tokens([*asked, reasoning, said, *then])
    assert with_thinking - without == len(f"<think>\n{THOUGHT}\n</think>\n\n".encode())


# llama.cpp's `/apply-template`, as its suite's test of past thinking sends it: two turns
# of a tool loop, each with its reasoning.
TOOL_LOOP: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the bug in main.py"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": THOUGHT,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "list_files", "arguments": '{"path": "."}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "main.py"},
]
LIST_FILES = {
    "type": "function",
    "function": {
        "name": "list_files",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def test_apply_template_is_the_chat_routes_prompt(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    def apply(**fields: Any) -> str:
        reply = httpx.post(server.url + "/apply-template", json={"messages": TOOL_LOOP, **fields})
        assert reply.status_code == 200, reply.text
        prompt: str = reply.json()["prompt"]
        return prompt

    prompt = apply()
    assert f"<think>\n{THOUGHT}\n</think>" in prompt and prompt == rendered(server, TOOL_LOOP)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert apply(add_generation_prompt=False) == prompt.removesuffix("<|im_start|>assistant\n")
    # With tools, the prompt the chat route builds (its tool instruction included): the
    # prompt's tokens are the chat's prompt tokens.
    offered = apply(tools=[LIST_FILES])
    assert offered != prompt
    tokens = httpx.post(server.url + "/tokenize", json={"text": offered}).json()["tokens"]
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=TOOL_LOOP,  # type: ignore[arg-type]
        tools=[LIST_FILES],  # type: ignore[list-item]
        max_tokens=1,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokens)
    refused = httpx.post(server.url + "/apply-template", json={"messages": []})
    assert refused.status_code == 400 and "messages" in refused.text
    unknown = httpx.post(server.url + "/apply-template", json={"messages": TOOL_LOOP, "model": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
