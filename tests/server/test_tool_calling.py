"""OpenAI tool calling with the official client (strict response validation) against real
servers on a tiny random model: its chat template knows no tools, so the generic format
(a system instruction, the reply one JSON object); and the same model served with a
Hermes-style template (``--chat-template``), whose calls are ``<tool_call>`` blocks. A random
model writes whatever the grammar allows: every call it makes must still validate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from slotserve.testing import write_tiny_hf_dir
from tests.server.conftest import ServerProcess, strict_client

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
MAX_TOKENS = 200
HERMES_TEMPLATE = """\
{% if tools %}<|im_start|>system
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for call in m.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_long_tiny(root: Path) -> Path:
    """The tiny Llama with room for the tools' instruction (every byte is a token)."""
    path = write_tiny_hf_dir(root / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return path


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_long_tiny(tmp_path_factory.mktemp("tools"))


def serve(model: Path, *flags: str) -> ServerProcess:
    return ServerProcess(str(model), "--max-seqs", "4", "--max-context", "2048", *flags)


@pytest.fixture(scope="module")
def generic(long_tiny: Path) -> Iterator[ServerProcess]:
    server = serve(long_tiny)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture(scope="module")
def hermes(long_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = serve(long_tiny, "--chat-template", str(template))
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def create(client: openai.OpenAI, server: ServerProcess, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=server.model_name, tools=TOOLS, **kwargs)


def ask(server: ServerProcess, **kwargs: Any) -> Any:
    with strict_client(server) as client:
        return create(client, server, **kwargs)


def streamed(server: ServerProcess, **kwargs: Any) -> dict[str, Any]:
    """A streamed reply put back together from its chunks: content, calls, finish."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with strict_client(server) as client:
        chunks = list(create(client, server, stream=True, **kwargs))
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # the first chunk of a call: id, type and name
                assert delta.index == len(calls) and delta.type == "function"
                assert delta.function.name and delta.function.arguments == ""
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def assert_valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_validate(generic: ServerProcess, seed: int) -> None:
    result = ask(generic, tool_choice="required", seed=seed)
    (choice,) = result.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert_valid(call.function.name, call.function.arguments)


def test_required_streamed_equals_the_whole(generic: ServerProcess) -> None:
    # Seeded sampling: the same tokens streamed or not (greedy may repeat calls forever).
    whole = ask(generic, tool_choice="required", seed=3)
    stream = streamed(generic, tool_choice="required", seed=3)
    assert stream["finish"] == "tool_calls" and stream["content"] == ""
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert [(c["name"], c["arguments"]) for c in stream["calls"]] == expected
    assert len({c["id"] for c in stream["calls"]}) == len(stream["calls"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_calls_only_that_function(generic: ServerProcess, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2, 3):
        if stream:
            reply = streamed(generic, tool_choice=choice, seed=seed)
            calls = [(c["name"], c["arguments"]) for c in reply["calls"]]
            finish = reply["finish"]
        else:
            message = ask(generic, tool_choice=choice, seed=seed).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls]
            finish = message.finish_reason
        assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_time"
        assert_valid(*calls[0])


def test_no_parallel_calls_makes_one(generic: ServerProcess) -> None:
    for seed in range(1, 5):
        result = ask(generic, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(result.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_or_calls(generic: ServerProcess, stream: bool) -> None:
    kinds = set()
    for seed in range(1, 7):
        if stream:
            reply = streamed(generic, tool_choice="auto", parallel_tool_calls=False, seed=seed)
            content, finish = reply["content"], reply["finish"]
            calls = [(c["name"], c["arguments"]) for c in reply["calls"]]
        else:
            # auto: the default with tools; one call, so a random model ends within budget
            (choice,) = ask(generic, parallel_tool_calls=False, seed=seed).choices
            content, finish = choice.message.content, choice.finish_reason
            calls = [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
            ]
        kinds.add("calls" if calls else "content")
        if calls:
            assert finish == "tool_calls" and not content
            for call in calls:
                assert_valid(*call)
        else:  # the generic format's answer: JSON content, decoded
            assert finish in ("stop", "length") and isinstance(content, str)
    assert kinds == {"calls", "content"}


def test_none_answers_in_plain_text(generic: ServerProcess) -> None:
    result = ask(generic, tool_choice="none", max_tokens=8, temperature=0)
    (choice,) = result.choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    with strict_client(generic) as client:
        plain = client.chat.completions.create(
            model=generic.model_name, messages=MESSAGES, max_tokens=8, temperature=0
        )
    assert choice.message.content == plain.choices[0].message.content  # the tools are not shown


def test_a_tool_result_is_sent_back_and_answered(generic: ServerProcess) -> None:
    first = ask(generic, tool_choice="required", seed=1)
    calls = first.choices[0].message.tool_calls
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}
        for call in calls
    ]
    turn = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True), *results]
    answer = ask(generic, messages=turn, tool_choice="none", max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    tokens = httpx.post(generic.url + "/tokenize", json={"messages": turn}).json()["tokens"]
    rendered = httpx.post(generic.url + "/detokenize", json={"tokens": tokens}).json()["text"]
    assert '"tool_calls": [{"name": "' in rendered and '"tool_response": {"id": "' in rendered
    assert calls[0].id in rendered


def test_usage_and_n_choices(generic: ServerProcess) -> None:
    result = ask(generic, tool_choice="required", n=2, seed=5)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.finish_reason == "tool_calls" for c in result.choices)
    assert result.usage is not None and result.usage.completion_tokens > 0


def bad(server: ServerProcess, **changes: Any) -> dict[str, Any]:
    body = {
        "model": server.model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 4,
        **changes,
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in error["message"]
    return error


def test_bad_input_is_400_naming_the_field(generic: ServerProcess) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}
    assert bad(generic, tools=[TOOLS[0], broken])["param"] == "tools.1.function.parameters"
    wrong_type = {"type": "object", "properties": {"a": {"type": "nope"}}}
    odd = {"type": "function", "function": {"name": "f", "parameters": wrong_type}}
    assert bad(generic, tools=[odd], tool_choice="required")["code"] == "invalid_schema"
    named = {"type": "function", "function": {"name": "missing"}}
    assert bad(generic, tool_choice=named)["param"] == "tool_choice.function.name"
    assert bad(generic, tools=[], tool_choice="required")["param"] == "tool_choice"
    orphan = [*MESSAGES, {"role": "tool", "tool_call_id": "call_x", "content": "21"}]
    assert bad(generic, messages=orphan)["param"] == "messages.1.tool_call_id"
    misnamed = {"type": "function", "function": {"name": "no spaces"}}
    assert bad(generic, tools=[misnamed])["param"] == "tools.0.function.name"
    twice = [TOOLS[0], TOOLS[0]]
    assert bad(generic, tools=twice)["param"] == "tools.1.function.name"
    assert bad(generic, response_format={"type": "json_object"})["param"] == "response_format"
    not_json = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}
    history = [*MESSAGES, {"role": "assistant", "tool_calls": [not_json]}]
    assert bad(generic, messages=history)["param"] == "messages.1.tool_calls.0.function.arguments"


# -- a template with tools of its own: Hermes-style <tool_call> blocks ---------------------


def test_hermes_template_calls_in_its_own_syntax(hermes: ServerProcess) -> None:
    result = ask(hermes, tool_choice="required", parallel_tool_calls=False, seed=2)
    (choice,) = result.choices
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert_valid(call.function.name, call.function.arguments)
    reply = streamed(hermes, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply["finish"] == "tool_calls" and [c["name"] for c in reply["calls"]] == [
        "get_weather"
    ]
    assert_valid("get_weather", reply["calls"][0]["arguments"])
    # The template renders the tools and the calls itself.
    turn = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "21"},
    ]
    tokens = httpx.post(hermes.url + "/tokenize", json={"messages": turn}).json()["tokens"]
    text = httpx.post(hermes.url + "/detokenize", json={"tokens": tokens}).json()["text"]
    assert '<tool_call>\n{"name": ' in text and "<tool_response>21</tool_response>" in text


def test_hermes_auto_leaves_free_text_free(hermes: ServerProcess) -> None:
    # A random model never writes "<tool_call>": the grammar stays off and the reply is text.
    (choice,) = ask(hermes, tool_choice="auto", max_tokens=24, seed=1).choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content
    reply = streamed(hermes, tool_choice="auto", max_tokens=24, seed=1)
    assert reply["content"] == choice.message.content and reply["calls"] == []
