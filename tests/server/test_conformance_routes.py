"""OpenAI spec conformance of ``/v1/embeddings`` and ``/v1/responses`` on a real server.

The schemas are OpenAI's own, copied by ``tools/extract_openapi_subset.py`` from the public
``openai-openapi.yaml`` into ``tests/data/openai-openapi-subset.yaml`` (createEmbedding,
createResponse and getResponse, with every component they reference). Two kinds of check:

* schemathesis, as ``test_conformance`` does for chat: generated requests (about 3 in 4
  steered toward success), no 5xx, and every documented 200 matching its response schema;
* chosen requests whose whole answers are judged by the operation's 200 schema, and whose
  streamed events are each judged by the spec component their ``type`` names (the spec's
  ``ResponseStreamEvent``), text, function calls and a tool result sent back.

The spec's ``Embedding.embedding`` is an array of numbers, so base64 answers (a string, as
OpenAI's own) are out of its reach: the steered cases ask for floats.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case
from schemathesis.errors import FailureGroup

from slotserve.server.chat.reasoning import CLOSE, OPEN
from slotserve.server.responses.request import ResponsesRequest
from slotserve.testing import TINY_VOCAB
from tests.server.conftest import ServerProcess
from tests.server.scripted_model import chain_of, write_scripted_qwen3
from tests.server.spec_checks import SPEC, EventJudge, Spec, errors, json_events, stream_post
from tests.server.test_conformance import (
    CHECKS,
    MAX_TEXT,
    MIN_OK,
    REQUEST_TIMEOUT_S,
    Operation,
    _capped,
    _doctored,
    _servable_message,
    operation_by_id,
)
from tests.server.test_reasoning import ANSWER, REASONING
from tests.server.test_tool_calling import WEATHER, serve, write_long_tiny

MAX_EXAMPLES = 40
MAX_OUTPUT = 8
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
RESPONSE_FIELDS = set(ResponsesRequest.model_fields) - {"stream"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny Llama with room for tool instructions (2,048 positions)."""
    process = serve(write_long_tiny(tmp_path_factory.mktemp("conformance")))
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec.load()


@pytest.fixture(scope="module")
def judge(spec: Spec) -> EventJudge:
    return EventJudge(spec)


@pytest.fixture(scope="module")
def schema(server: ServerProcess) -> BaseSchema:
    loaded = schemathesis.openapi.from_path(SPEC, config=schemathesis.Config())
    loaded.config.update(base_url=f"{server.url}/v1")
    loaded.config.output.sanitization.update(enabled=False)
    return loaded


# -- schemathesis: generated requests --------------------------------------------------------


def _servable_input(value: Any) -> Any:
    """An embeddings ``input`` the tiny model takes, from a generated one where possible."""
    if isinstance(value, str) and value:
        return value[:MAX_TEXT]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) and v for v in value):
            return [v[:MAX_TEXT] for v in value[:4]]
        if all(isinstance(v, int) for v in value):
            return [abs(v) % TINY_VOCAB for v in value[:MAX_TEXT]]
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [[abs(t) % TINY_VOCAB for t in v[:MAX_TEXT]] for v in value[:4]]
    return "Hello"


def steer_embedding(body: dict[str, Any], model: str) -> None:
    body["model"] = model
    body["input"] = _servable_input(body.get("input"))
    body["encoding_format"] = "float"  # the spec's embedding is an array of numbers
    body.pop("dimensions", None)  # refused (400) by design: the model has one width


def _servable_items(value: Any) -> Any:
    """A Responses ``input``: a short string, or the generated message items the server can
    render (text only)."""
    if isinstance(value, str) and value:
        return value[:MAX_TEXT]
    if isinstance(value, list):
        kept = [
            {"role": m["role"], "content": m["content"]}
            for m in value
            if isinstance(m, dict)
            and m.get("type", "message") == "message"
            and m.get("role") in ("user", "assistant", "system", "developer")
            and _servable_message({**m, "role": "user"})
            and isinstance(m.get("content"), str)
        ][:4]
        for message in kept:
            message["content"] = message["content"][:MAX_TEXT]
        if kept:
            return kept
    return "Hello"


def steer_response(body: dict[str, Any], model: str) -> None:
    for field in set(body) - RESPONSE_FIELDS:  # the many hosted features: 400 by design
        del body[field]
    body["model"] = model
    body["stream"] = False
    body["input"] = _servable_items(body.get("input"))
    body["max_output_tokens"] = _capped(body.get("max_output_tokens"), MAX_OUTPUT, MAX_OUTPUT)
    for field in ("tools", "tool_choice", "text", "previous_response_id"):
        body.pop(field, None)  # judged with chosen requests below
    if isinstance(body.get("instructions"), str):
        body["instructions"] = body["instructions"][:MAX_TEXT]


STEERS = {"createEmbedding": steer_embedding, "createResponse": steer_response}


@pytest.mark.parametrize("operation_id", sorted(STEERS))
def test_operation_conforms(schema: BaseSchema, server: ServerProcess, operation_id: str) -> None:
    """No 5xx and schema-conformant 200s, over generated (partly steered) requests."""
    operation = operation_by_id(schema, operation_id)
    steer = STEERS[operation_id]
    statuses: Counter[int] = Counter()
    lost: list[str] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )
    @given(case=operation.as_strategy(), steered=st.sampled_from([True, False]))
    def run_case(case: Case[Operation], steered: bool) -> None:
        if steered and isinstance(case.body, dict):
            steer(case.body, server.model_name)
        if lost:
            raise AssertionError(f"the server stopped answering ({lost[0]}); see the first error")
        try:
            response = case.call(timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            lost.append(type(exc).__name__)
            raise
        statuses[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)

    try:
        run_case()
    except BaseException as exc:
        exc.add_note(f"server log (tail):\n{server.output()[-4000:]}")
        raise
    breakdown = dict(sorted(statuses.items()))
    print(f"{operation_id}: {sum(statuses.values())} cases, statuses {breakdown}")
    assert statuses[200] >= MIN_OK, f"too few successful responses: {breakdown}"


# -- chosen requests: whole answers by the 200 schema ----------------------------------------


def judged(schema: BaseSchema, operation_id: str, body: Any) -> Any:
    """POST ``body`` as ``operation_id``; its answer must be a 200 conforming to the spec."""
    case = operation_by_id(schema, operation_id).Case(body=body, media_type="application/json")
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    case.validate_response(response, checks=CHECKS)
    return response.json()


def test_embeddings_conform(schema: BaseSchema, server: ServerProcess) -> None:
    model = server.model_name
    inputs: list[tuple[Any, int]] = [("hello there", 1), (["one", "two"], 2), ([5, 6, 7], 1)]
    for given_input, count in [*inputs, ([[5, 6], [7], [8]], 3)]:
        answer = judged(schema, "createEmbedding", {"model": model, "input": given_input})
        assert [item["index"] for item in answer["data"]] == list(range(count))
    for pooling in ("mean", "last"):  # slotserve's own field: the answer keeps OpenAI's shape
        judged(schema, "createEmbedding", {"model": model, "input": "a b", "pooling": pooling})


def create_body(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_name, "temperature": 0, **fields}


CALL = {
    "input": "weather in Paris?",
    "tools": TOOLS,
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_output_tokens": 200,
    "seed": 1,
}


def test_responses_conform(schema: BaseSchema, server: ServerProcess) -> None:
    text = judged(
        schema,
        "createResponse",
        create_body(server, input="hello", instructions="be brief", max_output_tokens=8),
    )
    assert text["status"] == "incomplete" and text["output"][0]["type"] == "message"
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you?"},
    ]
    judged(schema, "createResponse", create_body(server, input=items, max_output_tokens=4))
    call = judged(schema, "createResponse", create_body(server, **CALL))
    (item,) = call["output"]
    assert item["type"] == "function_call" and call["status"] == "completed"
    result = {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
    follow_up = create_body(
        server, input=[result], previous_response_id=call["id"], max_output_tokens=8
    )
    judged(schema, "createResponse", follow_up)
    # The stored response, read back, conforms too (getResponse).
    case = operation_by_id(schema, "getResponse").Case(path_parameters={"response_id": call["id"]})
    stored = case.call(timeout=REQUEST_TIMEOUT_S)
    assert stored.status_code == 200, stored.text
    case.validate_response(stored, checks=CHECKS)
    assert stored.json() == call


# -- chosen requests: streamed events, each by its spec component ----------------------------


def streamed_events(server: ServerProcess, judge: EventJudge, body: dict[str, Any]) -> list[Any]:
    events = json_events(stream_post(server.url + "/v1/responses", body))
    problems = [p for event in events for p in judge.problems(event)]
    assert not problems, "\n".join(problems[:20])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_response_events_conform(
    spec: Spec, judge: EventJudge, server: ServerProcess, schema: BaseSchema
) -> None:
    response = spec.validator("Response")
    text = streamed_events(
        server, judge, create_body(server, input="hello", instructions="hi", max_output_tokens=8)
    )
    kinds = Counter(e["type"] for e in text)
    assert kinds["response.output_text.delta"] >= 1 and kinds["response.incomplete"] == 1
    calls = streamed_events(server, judge, create_body(server, **CALL))
    kinds = Counter(e["type"] for e in calls)
    assert kinds["response.function_call_arguments.delta"] >= 1
    assert kinds["response.function_call_arguments.done"] == 1
    final = calls[-1]
    assert final["type"] == "response.completed"
    assert not errors(response, final["response"])
    # The streamed final response is the stored one, which getResponse serves as specified.
    stored = httpx.get(f"{server.url}/v1/responses/{final['response']['id']}", timeout=10)
    assert stored.status_code == 200 and stored.json() == final["response"]


def test_reasoning_items_conform(
    judge: EventJudge, spec: Spec, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A thinking model's reasoning item and events (``response.reasoning_text.*``)."""
    path: Path = tmp_path_factory.mktemp("thinker") / "model"
    write_scripted_qwen3(path, chain_of(OPEN, REASONING, CLOSE, ANSWER))
    thinker = ServerProcess(str(path), "--max-seqs", "2", "--max-context", "256")
    try:
        body = create_body(thinker, input="hi", max_output_tokens=32)
        whole = httpx.post(thinker.url + "/v1/responses", json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert not errors(spec.validator("Response"), answer)
        assert [item["type"] for item in answer["output"]] == ["reasoning", "message"]
        events = streamed_events(thinker, judge, body)
        kinds = {e["type"] for e in events}
        assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    finally:
        assert thinker.stop() == 0
    assert "Traceback" not in thinker.output(), thinker.output()


# -- controls: the checks can fail -----------------------------------------------------------


def test_checks_catch_bad_answers(
    schema: BaseSchema, judge: EventJudge, server: ServerProcess
) -> None:
    """A reshaped embedding, response or stream event fails the same checks."""
    operation = operation_by_id(schema, "createEmbedding")
    body: dict[str, Any] = {"model": server.model_name, "input": "hi"}
    case = operation.Case(body=body, media_type="application/json")
    real = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(real, checks=CHECKS)
    good = real.json()
    bad_item = {**good["data"][0], "embedding": "AAAA"}  # base64 is not the spec's array
    with pytest.raises(FailureGroup):
        case.validate_response(_doctored(real, 200, {**good, "data": [bad_item]}), checks=CHECKS)

    operation = operation_by_id(schema, "createResponse")
    body = create_body(server, input="hi", max_output_tokens=2)
    case = operation.Case(body=body, media_type="application/json")
    real = case.call(timeout=REQUEST_TIMEOUT_S)
    case.validate_response(real, checks=CHECKS)
    reshaped = {**real.json(), "status": "done"}
    with pytest.raises(FailureGroup):
        case.validate_response(_doctored(real, 200, reshaped), checks=CHECKS)

    events = streamed_events(server, judge, body)
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert judge.problems({**delta, "delta": 3})
    assert judge.problems({k: v for k, v in delta.items() if k != "item_id"})
    assert judge.problems({**delta, "type": "response.text.delta"})  # not a spec event
    done = events[-1]
    assert judge.problems({**done, "response": {**done["response"], "output": "x"}})


# -- chat with tools (issue 28's tool calls on the old route), whole and each chunk ----------

CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
]


def test_chat_tool_calls_conform(spec: Spec, server: ServerProcess) -> None:
    """A chat completion's tool calls by the spec's CreateChatCompletionResponse, and each
    streamed chunk (index, id and name, then argument fragments) by its
    CreateChatCompletionStreamResponse, in every tool_choice mode. By JSON Schema rather
    than schemathesis: the spec's ``ChatCompletionMessageToolCalls`` names a discriminator
    (``type``) without a mapping, so schemathesis expects the schemas' names
    (``ChatCompletionMessageToolCall``) where the spec's own enums say ``function``; its
    ``oneOf`` still decides."""
    chunk = spec.validator("CreateChatCompletionStreamResponse")
    completion = spec.validator("CreateChatCompletionResponse")
    question: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named, "auto", "none"):
        body: dict[str, Any] = {
            "model": server.model_name,
            "messages": question,
            "tools": CHAT_TOOLS,
            "tool_choice": choice,
            "max_tokens": 200,
            "seed": 1,
        }
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        whole = answer.json()
        assert not errors(completion, whole), errors(completion, whole)
        message = whole["choices"][0]["message"]
        if choice in ("required", named):
            assert whole["choices"][0]["finish_reason"] == "tool_calls"
            assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        events = stream_post(server.url + "/v1/chat/completions", body)
        assert events[-1].data == "[DONE]"
        payloads = [json.loads(event.data) for event in events[:-1]]
        problems = [p for payload in payloads for p in errors(chunk, payload)]
        assert not problems, "\n".join(problems[:20])
        if choice in ("required", named):
            assert any(
                delta.get("tool_calls")
                for payload in payloads
                for delta in (c["delta"] for c in payload["choices"])
            )
    # Control: a fragment without its index is not the spec's chunk.
    fragment = next(p for p in payloads if p["choices"])
    broken = {**fragment, "choices": [{**fragment["choices"][0], "delta": {"tool_calls": [{}]}}]}
    assert errors(chunk, broken)
