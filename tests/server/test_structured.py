"""Structured outputs, logit_bias and refused parameters, with the official openai client
against a real server (the tiny random model: whatever it prefers, the grammar decides)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml
from pydantic import BaseModel

from slotserve.server.chat.structured import GrammarCache
from slotserve.server.openai.schemas import (
    NO_OPS,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from slotserve.testing import tiny_model
from tests.server.conftest import ServerProcess
from tests.test_sampling import TINY_SCHEMA

SCHEMA = TINY_SCHEMA  # every property bounded: a random model finishes in ~70 tokens
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA}}
# Byte tokens of the tiny model for '"', '}' and ']': a small push towards closing strings,
# objects and arrays, so free-form JSON objects from a random model end within the budget.
CLOSERS = {"4": 5, "95": 5, "63": 5}
MAX_TOKENS = 160


def ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "a point, please"}]
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def streamed_choices(stream: Any) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason, from the chunks of a stream."""
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return {index: (text, finishes.get(index)) for index, text in texts.items()}


def outputs(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any) -> list[Any]:
    """(text, finish reason) of each of n=2 choices, streamed or not."""
    if stream:
        result = streamed_choices(ask(client, model, n=2, stream=True, **kwargs))
        return [result[0], result[1]]
    response = ask(client, model, n=2, **kwargs)
    return [(c.message.content, c.finish_reason) for c in response.choices]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_output_validates(
    client: openai.OpenAI, tiny_server: ServerProcess, stream: bool, temperature: float
) -> None:
    for text, finish in outputs(
        client,
        tiny_server.model_name,
        stream,
        temperature=temperature,
        seed=7,
        response_format=JSON_SCHEMA_FORMAT,
    ):
        assert finish == "stop", text
        document = json.loads(text)
        jsonschema.validate(document, SCHEMA)
        assert document["kind"] == "point" and document["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_object_output_parses(
    client: openai.OpenAI, tiny_server: ServerProcess, stream: bool, temperature: float
) -> None:
    for text, finish in outputs(
        client,
        tiny_server.model_name,
        stream,
        temperature=temperature,
        seed=3,
        logit_bias=CLOSERS,
        response_format={"type": "json_object"},
    ):
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict)


def test_truncated_json_is_a_valid_prefix(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    """finish_reason stays honest: "length" when the budget cuts the document short."""
    response = client.chat.completions.create(
        model=tiny_server.model_name,
        messages=[{"role": "user", "content": "a point"}],
        max_tokens=12,
        temperature=0,
        response_format=JSON_SCHEMA_FORMAT,  # type: ignore[arg-type]
    )
    choice = response.choices[0]
    full = ask(client, tiny_server.model_name, temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert choice.finish_reason == "length"
    assert full.choices[0].message.content.startswith(choice.message.content)


def test_constrained_and_free_requests_in_one_batch(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    """Run together (co-batched: the engine batches every running request each step), each
    request gives what it gives alone: the mask of one never touches the other's row."""
    model = tiny_server.model_name
    kinds: dict[str, dict[str, Any]] = {
        "free": {"temperature": 0},
        "constrained": {"temperature": 0, "response_format": JSON_SCHEMA_FORMAT},
    }
    alone = {
        name: ask(client, model, **kw).choices[0].message.content for name, kw in kinds.items()
    }
    together: dict[str, str] = {}

    def run(name: str) -> None:
        together[name] = ask(client, model, **kinds[name]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(name,)) for name in kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
    jsonschema.validate(json.loads(together["constrained"]), SCHEMA)
    with pytest.raises(json.JSONDecodeError):
        json.loads(together["free"])  # the free request was not constrained


def test_logit_bias_removes_and_forces_tokens(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    model = tiny_server.model_name
    greedy = client.completions.create(
        model=model, prompt="abc", max_tokens=1, temperature=0, logprobs=0
    )
    first = greedy.choices[0].text
    ids = httpx.post(tiny_server.url + "/tokenize", json={"text": first}).json()["tokens"]
    assert len(ids) == 1
    banned = client.completions.create(
        model=model, prompt="abc", max_tokens=1, temperature=0, logit_bias={str(ids[0]): -100}
    )
    assert banned.choices[0].text != first
    forced = client.completions.create(
        model=model, prompt="abc", max_tokens=4, temperature=1.0, logit_bias={"36": 100}
    )
    assert forced.choices[0].text == "BBBB"  # token 36 is the byte "B"


@pytest.mark.parametrize(
    "bias,fragment",
    [({"999999": 1}, "not in this model's vocabulary"), ({"x": 1}, "not a token id")],
)
def test_bad_logit_bias_is_400(
    client: openai.OpenAI, tiny_server: ServerProcess, bias: dict[str, int], fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, tiny_server.model_name, max_tokens=1, logit_bias=bias)
    assert fragment in str(info.value) and info.value.param == "logit_bias"  # type: ignore[attr-defined]


def test_unsupported_schema_feature_is_named(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as info:
        ask(
            client,
            tiny_server.model_name,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )
    assert "uniqueItems" in str(info.value)
    assert info.value.param == "response_format.json_schema.schema"  # type: ignore[attr-defined]


def test_grammar_cache_compiles_each_schema_once(tmp_path: Path) -> None:
    """A served model's grammars share one compiler (one tokenizer index); the same schema
    text is compiled once, and the least recently used grammar leaves a full cache."""
    model = tiny_model(tmp_path / "a")
    cache = GrammarCache(model, size=2)
    assert cache.compiler.tokenizer is model.tokenizer
    assert cache.compiler.vocab_size == model.info.vocab_size
    schemas = [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}]
    first = cache.get(schemas[0])
    assert cache.get(dict(schemas[0])) is first
    cache.get(schemas[1])
    cache.get(schemas[2])  # evicts schemas[0], the least recently used
    assert cache.get(schemas[0]) is not first


def test_routes_without_v1(tiny_server: ServerProcess) -> None:
    model = tiny_server.model_name
    assert httpx.get(tiny_server.url + "/models").json()["data"][0]["id"] == model
    body = {"model": model, "max_tokens": 2, "temperature": 0}
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    for path, payload in (("/chat/completions", chat), ("/completions", {**body, "prompt": "a"})):
        plain = httpx.post(tiny_server.url + path, json=payload).json()
        prefixed = httpx.post(tiny_server.url + "/v1" + path, json=payload).json()
        assert plain["choices"] == prefixed["choices"]


def test_text_parts_are_joined_with_a_newline(tiny_server: ServerProcess) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]

    def tokens(content: Any) -> list[int]:
        messages = [{"role": "user", "content": content}]
        response = httpx.post(tiny_server.url + "/tokenize", json={"messages": messages})
        return list(response.json()["tokens"])

    assert tokens(parts) == tokens("What is\nthe best book")


# --- no field silently ignored --------------------------------------------------------

SPEC = Path(__file__).parents[1] / "data" / "openai-openapi-subset.yaml"
# A value for each refused field that asks for something this server does not do.
REFUSED_VALUES: dict[str, Any] = {
    "functions": [{"name": "lookup"}],
    "function_call": {"name": "lookup"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {"search_context_size": "low"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"},
    "suffix": "the end",
    "best_of": 3,
}
# Values of the same fields that ask for nothing, and no-op fields: all accepted.
HARMLESS_VALUES: dict[str, Any] = {
    "tools": [],
    "tool_choice": "none",
    "modalities": ["text"],
    "suffix": "",
    "best_of": 1,
    "user": "u-1",
    "store": True,
    "metadata": {"team": "a"},
    "service_tier": "auto",
    "parallel_tool_calls": True,
}


def spec_fields(schema_name: str) -> set[str]:
    schemas = yaml.safe_load(SPEC.read_text())["components"]["schemas"]

    def fields(name: str) -> set[str]:
        found: set[str] = set()
        schema = schemas[name]
        for part in schema.get("allOf", [schema]):
            if "$ref" in part:
                found |= fields(part["$ref"].rsplit("/", 1)[1])
            found |= set(part.get("properties", {}))
        return found

    return fields(schema_name)


def implemented(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(
    "schema_name,model",
    [
        ("CreateChatCompletionRequest", ChatCompletionRequest),
        ("CreateCompletionRequest", CompletionRequest),
    ],
)
def test_every_spec_field_is_implemented_refused_or_a_no_op(
    schema_name: str, model: type[BaseModel]
) -> None:
    fields = spec_fields(schema_name)
    assert len(fields) > 10  # the spec was read
    unaccounted = fields - implemented(model) - NO_OPS - set(UNSUPPORTED)
    assert not unaccounted, f"silently ignored: {sorted(unaccounted)}"
    assert not implemented(model) & set(UNSUPPORTED)
    assert set(REFUSED_VALUES) == set(UNSUPPORTED)  # each refusal is tested below


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_unsupported_parameter_is_400_naming_it(
    tiny_server: ServerProcess, field: str, kind: str
) -> None:
    body: dict[str, Any] = {"model": tiny_server.model_name, "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "a"}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    response = httpx.post(tiny_server.url + path, json={**body, field: REFUSED_VALUES[field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field
    assert field in error["message"]


def test_harmless_values_are_accepted(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    chat_only = {"tools", "tool_choice", "modalities", "store", "metadata", "parallel_tool_calls"}
    chat = {k: v for k, v in HARMLESS_VALUES.items() if k not in ("suffix", "best_of")}
    ask(client, tiny_server.model_name, max_tokens=1, extra_body=chat)
    text = {k: v for k, v in HARMLESS_VALUES.items() if k not in chat_only}
    client.completions.create(
        model=tiny_server.model_name, prompt="a", max_tokens=1, extra_body=text
    )
