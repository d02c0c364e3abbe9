"""Issue 53, items 4 and 5: the grammars and samplers llama.cpp's server and vLLM accept,
with the official openai client (strict) against a real server on the tiny random model,
whose preferences are noise: what shapes its output is the grammar or the sampler.

Grammars: llama.cpp's ``grammar`` (GBNF) and ``json_schema``, vLLM's ``guided_regex``,
``guided_choice``, ``guided_grammar`` (Lark) and ``structured_outputs``, on chat and text
completions, whole and streamed; one constraint a request; a grammar that does not parse,
or one past the compile bound, is a 400 naming its field. Fields: llama.cpp's and vLLM's
that are not implemented are a 400 ``unsupported_parameter`` naming them unless their value
asks for nothing; a field no API defines is reported in ``X-Slotserve-Ignored-Fields``.
Samplers: each is taken, seeded output repeats, values out of range name the field."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import jsonschema
import openai
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from slotserve.server.openai.peer_fields import (
    IGNORED_FIELDS_HEADER,
    PEER_UNSUPPORTED,
    ignored_header,
)
from tests.server.conftest import ServerProcess

YES_NO = 'root ::= "yes" | "no"'
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    flags = ["--max-seqs", "4", "--max-context", "256", "--grammar-timeout", "3"]
    process = ServerProcess(str(tiny_dirs["llama"]), *flags)
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.output(), process.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        yield client


def chat_text(client: openai.OpenAI, server: ServerProcess, stream: bool, **extra: Any) -> str:
    ask: dict[str, Any] = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "answer"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": extra,
    }
    if not stream:
        answer = client.chat.completions.create(**ask)
        assert answer.choices[0].finish_reason == "stop", answer
        return answer.choices[0].message.content or ""
    text, finish = "", None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    return text


def text_completion(client: openai.OpenAI, server: ServerProcess, **extra: Any) -> str:
    answer = client.completions.create(
        model=server.model_name,
        prompt="a",
        max_tokens=40,
        temperature=1.0,
        seed=5,
        extra_body=extra,
    )
    assert answer.choices[0].finish_reason == "stop", answer
    return answer.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "extra,check",
    [
        ({"grammar": YES_NO}, lambda t: t in ("yes", "no")),
        ({"grammar": 'root ::= [0-9]{2,3} "!"'}, lambda t: re.fullmatch(r"[0-9]{2,3}!", t)),
        ({"guided_regex": "[a-c]{3}-[0-9]"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]", t)),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_grammar": 'start: "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        ({"structured_outputs": {"regex": "ab+c"}}, lambda t: re.fullmatch("ab+c", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": YES_NO}}, lambda t: t in ("yes", "no")),
        ({"json_schema": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        ({"guided_json": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
        (  # llama.cpp's form: a schema inside a json_object response format
            {"response_format": {"type": "json_object", "schema": POINT}},
            lambda t: jsonschema.validate(json.loads(t), POINT) is None,
        ),
        (
            {"structured_outputs": {"json": json.dumps(POINT)}},
            lambda t: jsonschema.validate(json.loads(t), POINT) is None,
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_chat_output_follows_each_grammar(
    client: openai.OpenAI, server: ServerProcess, stream: bool, extra: dict[str, Any], check: Any
) -> None:
    text = chat_text(client, server, stream, **extra)
    assert check(text), text


@pytest.mark.parametrize(
    "extra,pattern",
    [
        ({"guided_regex": "[0-9]+(\\.[0-9]+)?"}, r"[0-9]+(\.[0-9]+)?"),
        ({"grammar": YES_NO}, "yes|no"),
        ({"guided_choice": ["one", "two", "three"]}, "one|two|three"),
    ],
)
def test_completions_output_follows_each_grammar(
    client: openai.OpenAI, server: ServerProcess, extra: dict[str, Any], pattern: str
) -> None:
    assert re.fullmatch(pattern, text_completion(client, server, **extra))


def post(server: ServerProcess, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
    base = {"model": server.model_name, "max_tokens": 4, "temperature": 0}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "a"
    return httpx.post(server.url + path, json={**base, **body}, timeout=60)


def test_two_constraints_are_a_400_naming_the_second(server: ServerProcess) -> None:
    response = post(server, {"grammar": YES_NO, "guided_regex": "a+"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "guided_regex" and "grammar" in error["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"grammar": 'root ::= "a" missing'}, "grammar"),
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_grammar": 'start: "a" )'}, "guided_grammar"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ],
)
def test_a_grammar_that_does_not_parse_is_a_400_naming_it(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_grammar"
    assert error["message"].startswith(param + ": ")


def test_a_grammar_past_the_compile_bound_is_a_fast_400(server: ServerProcess) -> None:
    """A Lark grammar holding the hostile schema of issue 30 (an allOf of 40 patterns,
    exponential to compile) stops at a compile bound, as the schema does."""
    hostile = {"type": "string", "allOf": [{"pattern": f"[a-z]{{{i},}}"} for i in range(1, 41)]}
    start = time.monotonic()
    response = post(server, {"guided_grammar": f"start: %json {json.dumps(hostile)}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar" and error["code"] == "schema_too_complex"
    assert re.search(r"--grammar-(timeout 3 s|max-bytes)", error["message"])  # the bound hit
    assert time.monotonic() - start < 10


def test_a_grammar_with_tools_is_a_400(server: ServerProcess) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = post(server, {"grammar": YES_NO, "tools": [tool], "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "grammar"


# -- fields ------------------------------------------------------------------------------


def test_a_field_no_api_defines_is_reported(server: ServerProcess) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = post(server, {"foo_bar": 1, "zeta": "x", "cache_prompt": True}, path)
        assert response.status_code == 200, response.text
        assert response.headers[IGNORED_FIELDS_HEADER] == "foo_bar,zeta"  # cache_prompt: no-op
    assert IGNORED_FIELDS_HEADER not in post(server, {}).headers
    assert "foo_bar" in server.output()  # and logged


# A value of each unimplemented peer field that asks for something.
REFUSED = {
    "n_probs": 3,
    "n_indent": 2,
    "n_discard": 4,
    "t_max_predict_ms": 100,
    "min_keep": 2,
    "samplers": ["top_k"],
    "dynatemp_range": 0.5,
    "dynatemp_exponent": 2.0,
    "penalize_nl": True,
    "tfs_z": 0.9,
    "grammar_lazy": True,
    "grammar_triggers": [{"type": 0, "value": "x"}],
    "preserved_tokens": ["<x>"],
    "post_sampling_probs": True,
    "response_fields": ["content"],
    "return_tokens": True,
    "return_progress": True,
    "lora": [{"id": 0, "scale": 1.0}],
    "image_data": [{"data": "x", "id": 1}],
    "multimodal_data": ["x"],
    "use_beam_search": True,
    "length_penalty": 0.5,
    "stop_token_ids": [5],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5,
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "continue_final_message": True,
    "documents": [{"title": "t"}],
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"a": 1},
    "structural_tag": "{}",
    "guided_whitespace_pattern": " ",
    "logits_processors": ["x"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "prompt_embeds": "x",
    "thinking_token_budget": 10,
}


@given(st.lists(st.text(), min_size=1, max_size=40))
@example([" starts with a space"])
@example(["ü", "ends with a tab\t"])
def test_any_field_names_make_a_header_http_allows(names: list[str]) -> None:
    """A client's JSON keys are any strings (the conformance fuzzer sent one ending in a
    space: h11 refused the header and the reply was a 500); the header's value is always
    one HTTP allows."""
    ((name, value),) = ignored_header(names).items()
    h11.Response(status_code=200, headers=[(name, value)])  # raises on an illegal value
    assert len(value.split(",")) == min(len(names), 32)


def test_every_refused_peer_field_has_a_refused_value() -> None:
    assert set(REFUSED) | {"repeat_last_n", "penalty_last_n"} == set(PEER_UNSUPPORTED)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_an_unimplemented_peer_field_is_a_400_naming_it(server: ServerProcess, field: str) -> None:
    response = post(server, {field: REFUSED[field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field


def test_harmless_peer_values_are_accepted(server: ServerProcess) -> None:
    harmless = {
        "n_probs": 0,
        "samplers": [],
        "skip_special_tokens": True,
        "use_beam_search": False,
        "repeat_last_n": 64,  # no penalty in force: no window matters
        "cache_prompt": False,
        "id_slot": -1,
        "guided_decoding_backend": "auto",
        "add_generation_prompt": True,
    }
    response = post(server, harmless)
    assert response.status_code == 200, response.text
    window = post(server, {"repeat_last_n": 64, "repeat_penalty": 1.2})
    assert window.status_code == 400 and window.json()["error"]["param"] == "repeat_last_n"
    assert post(server, {"repeat_last_n": -1, "repeat_penalty": 1.2}).status_code == 200


def test_llama_cpp_names_for_the_budget_and_the_penalty(server: ServerProcess) -> None:
    answer = post(server, {"n_predict": 3, "max_tokens": None, "ignore_eos": True})
    assert answer.json()["usage"]["completion_tokens"] == 3
    text = post(server, {"n_predict": 5, "max_tokens": None, "ignore_eos": True}, "/v1/completions")
    assert text.json()["usage"]["completion_tokens"] == 5


# -- samplers ----------------------------------------------------------------------------

SAMPLERS: list[dict[str, Any]] = [
    {"typical_p": 0.5},
    {"top_n_sigma": 1.0},
    {"xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2},
    {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "x"], "dry_penalty_last_n": 32},
    {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"min_tokens": 6},
]


@pytest.mark.parametrize("fields", SAMPLERS, ids=lambda f: next(iter(f)))
def test_each_sampler_is_taken_and_seeded(
    client: openai.OpenAI, server: ServerProcess, fields: dict[str, Any]
) -> None:
    ask: dict[str, Any] = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 11,
        "extra_body": fields,
    }
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.usage is not None and first.usage.completion_tokens >= fields.get("min_tokens", 1)


def test_min_tokens_holds_the_end_back(server: ServerProcess) -> None:
    """The tiny model pushed to end at once (a bias on its end-of-sequence token) writes
    min_tokens tokens first."""
    end = {"2": 100}  # the tiny models' <|im_end|>
    quick = post(server, {"logit_bias": end, "max_tokens": 20})
    assert quick.json()["usage"]["completion_tokens"] <= 1
    held = post(server, {"logit_bias": end, "max_tokens": 20, "min_tokens": 7})
    assert held.json()["usage"]["completion_tokens"] in (7, 8)  # then the end (if counted)
    assert held.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "field,value",
    [
        ("typical_p", 0.0),
        ("typical_p", 1.5),
        ("xtc_probability", 2.0),
        ("dry_base", 0.5),
        ("dry_allowed_length", -1),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", []),
        ("mirostat", 3),
        ("min_tokens", 50),
    ],
)
def test_a_sampler_value_out_of_range_names_the_field(
    server: ServerProcess, field: str, value: Any
) -> None:
    response = post(server, {field: value, "max_tokens": 20})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"]
    assert error["param"] in (field, None)  # a cross-field check names it in the message


def test_min_tokens_holds_stop_strings_back_until_its_token(server: ServerProcess) -> None:
    """A stop string ends the output only where it lies in the text from the min_tokens-th
    token on (vLLM's min_tokens; `StopMatcher`): the greedy text's first characters, as a
    stop string, end it at once without min_tokens and at their first occurrence from
    that token on with it (or at the budget)."""
    fields = {"max_tokens": 24, "min_tokens": 24, "logprobs": 0}
    base = post(server, fields, "/v1/completions").json()["choices"][0]
    text, offsets = base["text"], base["logprobs"]["text_offset"]
    stop = text[:1]
    assert stop and len(offsets) == 24
    alone = post(server, {"max_tokens": 24, "stop": [stop]}, "/v1/completions").json()
    assert alone["choices"][0]["text"] == ""
    for minimum in (2, 6, 12):
        start = offsets[minimum - 1] - offsets[0]
        found = text.find(stop, start)
        expected = text if found < 0 else text[:found]
        body = {"max_tokens": 24, "min_tokens": minimum, "stop": [stop]}
        response = post(server, body, "/v1/completions")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected, (minimum, text)
