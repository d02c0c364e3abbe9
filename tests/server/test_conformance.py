"""Schemathesis conformance: generated requests against OpenAI's spec, sent to a real server.

The spec is ``tests/data/openai-openapi-subset.yaml`` (made by
``tools/extract_openapi_subset.py``). For each operation, hypothesis draws requests from the
request schema; every response must not be a 5xx, and a documented status (200) must match the
documented content type and response schema. Undocumented statuses (our 400/401/404/429 error
bodies) are not judged. About 3 in 4 cases are steered toward success: the served model name,
small token budgets, ``n`` <= 2, no streaming (the spec's SSE schema describes the payload, not
the events), prompts the tiny model can take, no ``logit_bias``, function tools with valid
names and tool results that answer a call; so 200s are exercised and counted.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, BaseSchema, Case, Response
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from slotserve.server.openai.schemas import UNSUPPORTED
from slotserve.testing import TINY_VOCAB
from tests.server.conftest import ServerProcess

SPEC = Path(__file__).parents[1] / "data" / "openai-openapi-subset.yaml"
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
MAX_EXAMPLES = 40
REQUEST_TIMEOUT_S = 20  # a steered generation takes well under a second
MIN_OK = 10  # successful (200) responses each operation must reach (typically 20-35)
MAX_TOKENS = 8
MAX_N = 2
MAX_TEXT = 24  # characters kept per steered prompt/message: bytes are tokens in the tiny model
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}

Operation = APIOperation[Any, Any, Any, Any]


@pytest.fixture(scope="module")
def schema(tiny_server: ServerProcess) -> BaseSchema:
    """The subset spec, aimed at the server's /v1 routes."""
    loaded = schemathesis.openapi.from_path(SPEC, config=schemathesis.Config())
    loaded.config.update(base_url=f"{tiny_server.url}/v1")
    # Reproductions show every field: "max_tokens" would be masked as a secret-like key.
    loaded.config.output.sanitization.update(enabled=False)
    return loaded


def operation_by_id(schema: BaseSchema, operation_id: str) -> Operation:
    """The operation with ``operation_id``; a spec error in any operation is raised."""
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operation = result.ok()
        if operation.definition.raw.get("operationId") == operation_id:
            return operation
    raise LookupError(operation_id)


def _capped(value: Any, cap: int, default: int) -> int:
    """``value`` as an int in 1..cap; ``default`` when it is not a number (or null)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(min(max(value, 1), cap))
    return default


def _short(value: Any) -> Any:
    return value[:MAX_TEXT] if isinstance(value, str) else value


def _servable_message(message: Any) -> bool:
    """Whether the server can render ``message`` (a role it knows, text-only content)."""
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
        for p in content
    )


def _servable_prompt(prompt: Any) -> str | list[int]:
    """One prompt the tiny model accepts, taken from a generated ``prompt`` where possible."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt[:MAX_TEXT]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [abs(t) % TINY_VOCAB for t in prompt[:MAX_TEXT]]
    return "Hello"


def _answered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` less each tool result that answers no earlier assistant tool call; a
    call's arguments that are not JSON become ``{}``."""
    kept: list[dict[str, Any]] = []
    calls: set[Any] = set()
    for message in messages:
        if message["role"] == "tool" and message.get("tool_call_id") not in calls:
            continue
        if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [
                call
                for call in message["tool_calls"]
                if isinstance(call, dict) and call.get("type") == "function" and call.get("id")
            ] or None
        for call in message.get("tool_calls") or []:
            function = call.get("function")
            if isinstance(function, dict):
                try:
                    json.loads(function.get("arguments", ""))
                except (TypeError, ValueError):
                    function["arguments"] = "{}"
            calls.add(call["id"])
        kept.append(message)
    return kept


def _function_tools(tools: list[Any]) -> list[Any]:
    """The function tools, each under a valid name given once."""
    kept, names = [], set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            continue
        name = re.sub(r"[^A-Za-z0-9_-]", "_", str(function.get("name", "")))[:60] or "f"
        function["name"] = name if name not in names else f"{name}{len(names)}"
        names.add(function["name"])
        kept.append(tool)
    return kept


def steer(case: Case[Operation], model: str) -> None:
    """Make ``case`` likely to succeed: served model, bounded work, no streaming."""
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = model
    if not isinstance(case.body, dict):
        return
    body: dict[str, Any] = case.body
    body["model"] = model
    body["stream"] = False
    for refused in UNSUPPORTED:  # fields the server refuses by design (400, not judged)
        body.pop(refused, None)
    budgets = [k for k in ("max_tokens", "max_completion_tokens") if k in body]
    for key in budgets or ["max_tokens"]:
        body[key] = _capped(body.get(key), MAX_TOKENS, default=MAX_TOKENS)
    if body.get("n") is not None:
        body["n"] = _capped(body["n"], MAX_N, default=1)
    for key in ("seed", "top_logprobs"):  # the spec's integers, drawn as 0.0
        if isinstance(body.get(key), float) and body[key].is_integer():
            body[key] = int(body[key])
    if "messages" in body:
        kept = _answered([m for m in body["messages"] if _servable_message(m)])[:4]
        for message in kept:
            message["content"] = _short(message.get("content"))
            for part in message["content"] if isinstance(message["content"], list) else []:
                part["text"] = _short(part.get("text", ""))
        body["messages"] = kept or [{"role": "user", "content": "Hello"}]
    body.pop("logit_bias", None)  # random keys are not token ids
    if isinstance(body.get("tools"), list):
        body["tools"] = _function_tools(body["tools"])
    if "tool_choice" in body and body["tool_choice"] not in ("none", "auto", "required"):
        body["tool_choice"] = "auto"  # a named or allowed-tools choice rarely names a tool
    if "prompt" in body:
        body["prompt"] = _servable_prompt(body["prompt"])


OPERATIONS = ["createChatCompletion", "createCompletion", "listModels", "retrieveModel"]


@pytest.mark.parametrize("operation_id", OPERATIONS)
def test_operation_conforms(
    schema: BaseSchema, tiny_server: ServerProcess, operation_id: str
) -> None:
    """No 5xx and schema-conformant 200s, over generated (partly steered) requests."""
    operation = operation_by_id(schema, operation_id)
    model = tiny_server.model_name
    route = "/v1" + operation.path
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
    # Hypothesis favours the first choice: about 3 in 4 cases come out steered.
    @given(case=operation.as_strategy(), steered=st.sampled_from([True, False]))
    def run_case(case: Case[Operation], steered: bool) -> None:
        if steered:
            steer(case, model)
        if lost:  # the server stopped answering: fail fast instead of waiting on each shrink
            raise AssertionError(f"the server stopped answering ({lost[0]}); see the first error")
        try:
            response = case.call(timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            lost.append(type(exc).__name__)
            raise
        statuses[response.status_code] += 1
        sent = urlsplit(str(response.request.url)).path
        assert sent == route or ("{" in route and sent.startswith(route.split("{")[0])), sent
        case.validate_response(response, checks=CHECKS)

    try:
        run_case()
    except BaseException as exc:
        exc.add_note(f"server log (tail):\n{tiny_server.output()[-4000:]}")
        raise
    breakdown = dict(sorted(statuses.items()))
    print(f"{operation_id}: {sum(statuses.values())} cases, statuses {breakdown}")
    assert statuses[200] >= MIN_OK, f"too few successful responses: {breakdown}"


def _doctored(response: Response, status: int, body: Any) -> Response:
    """``response`` with another status and JSON body (same request)."""
    return Response(
        status_code=status,
        headers={"content-type": ["application/json"]},
        content=json.dumps(body).encode(),
        request=response.request,
        elapsed=response.elapsed,
        verify=response.verify,
    )


def test_checks_catch_bad_responses(schema: BaseSchema, tiny_server: ServerProcess) -> None:
    """Control: the checks pass a real completion and fail a 5xx or a reshaped one."""
    operation = operation_by_id(schema, "createChatCompletion")
    body: dict[str, Any] = {"model": tiny_server.model_name, "max_tokens": 4}
    body["messages"] = [{"role": "user", "content": "Hi"}]
    case = operation.Case(body=body, media_type="application/json")
    response = case.call(timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    case.validate_response(response, checks=CHECKS)
    good = response.json()
    bad_choice = {**good["choices"][0], "finish_reason": "done"}
    for status, bad in [(500, good), (200, {**good, "choices": [bad_choice]})]:
        with pytest.raises(FailureGroup):
            case.validate_response(_doctored(response, status, bad), checks=CHECKS)
