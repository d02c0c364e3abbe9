"""A thinking model's ``<think>…</think>`` section returned apart (issue 28, item 5):
``reasoning_content`` in chat completions (``delta.reasoning_content`` streamed), a reasoning
item in the Responses API, a ``thinking`` block in Anthropic's Messages; kept inline with
``reasoning_format: "none"`` (the request's, or the server's ``--reasoning-format``);
``chat_template_kwargs`` (``enable_thinking``) reaches the template; tool calls are still
read after a thinking section.

The server runs `scripted_model`'s tiny Qwen3, whose greedy reply is a chosen chain of
tokens: ``<think>reason</think>OK`` (the thinker), ``<think>plan</think><tool_call>`` and
then the call its grammar writes (the caller). The official ``openai`` and ``anthropic``
clients read the answers, validating them strictly.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotserve.server.chat.reasoning import (
    CLOSE,
    OPEN,
    Reasoning,
    ReasoningSplitter,
    plan_reasoning,
    split_reasoning,
    thinks,
)
from slotserve.server.chat.reply import ReplyShape, ReplyStream
from slotserve.server.chat.tool_formats import HERMES
from slotserve.testing import CHAT_TEMPLATE, tiny_tokenizer
from slotserve.tokenizer import Tokenizer
from tests.server.conftest import ServerProcess, strict_client
from tests.server.scripted_model import THINKING_TEMPLATE, chain_of, write_scripted_qwen3

REASONING, ANSWER = "reason", "OK"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA},
}
HI = [{"role": "user", "content": "hi"}]

# -- the split, as a pure function of text -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "starts_open", "reasoning", "content"),
    [
        ("<think>\nabc\n</think>\n\nOK", False, "abc", "OK"),
        ("Hello <think>x</think>", False, None, "Hello <think>x</think>"),  # not at the start
        ("  <think>x", False, "x", ""),  # never closed: runs to the end
        ("<thinking>x", False, None, "<thinking>x"),
        ("<think>\n\n</think>\n\nOK", False, None, "OK"),  # an empty section
        ("abc </think> OK", True, "abc", "OK"),  # the prompt opened it
        ("a\n\nb</think>c", True, "a\n\nb", "c"),
        ("<thi", False, None, "<thi"),
        ("", True, None, ""),
    ],
)
def test_split(text: str, starts_open: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, starts_open) == (reasoning, content)


PIECES = st.sampled_from([OPEN, CLOSE, "<", "</thi", "nk>", "a", "bc", " ", "\n", "x y"])


@given(st.lists(PIECES, max_size=12), st.lists(st.integers(0, 40), max_size=8), st.booleans())
def test_streamed_parts_join_to_the_whole_split(
    pieces: list[str], cuts: list[int], starts_open: bool
) -> None:
    """However a reply's text arrives, its reasoning and content are the whole text's."""
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    splitter = ReasoningSplitter(starts_open)
    parts = []
    for start, end in itertools.pairwise(bounds):
        parts += splitter.push(text[start:end])
    parts += splitter.push("", final=True)
    reasoning = "".join(t for kind, t in parts if kind == "reasoning") or None
    content = "".join(t for kind, t in parts if kind == "content")
    assert (reasoning, content) == split_reasoning(text, starts_open)
    assert all(t for _, t in parts)  # no empty part is sent


def test_reply_stream_reads_calls_after_the_section() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    stream = ReplyStream(ReplyShape(HERMES, Reasoning(starts_open=False)))
    deltas = [d for ch in f"<think>I <tool_call> x</think>{call}" for d in stream.push(ch)]
    deltas += stream.push("", final=True)
    assert "".join(d.get("reasoning", "") for d in deltas) == "I <tool_call> x"
    assert not "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "f" and stream.called
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"a": 1}


def tokenizer_with(template: str) -> Tokenizer:
    return Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[2], chat_template=template)


def test_a_model_thinks_by_its_template() -> None:
    assert thinks(tokenizer_with(THINKING_TEMPLATE))
    assert not thinks(tokenizer_with(CHAT_TEMPLATE))
    plain = tokenizer_with(CHAT_TEMPLATE)
    assert plan_reasoning(plain, plain.encode_chat(HI), "auto") is None
    thinking = tokenizer_with(THINKING_TEMPLATE)
    assert plan_reasoning(thinking, thinking.encode_chat(HI), "none") is None


@pytest.mark.parametrize(
    ("generation_prompt", "starts_open"),
    [("", False), ("<think>\n", True), ("<think>\n\n</think>\n\n", False)],
)
def test_a_prompt_that_opens_the_section_starts_the_reply_in_it(
    generation_prompt: str, starts_open: bool
) -> None:
    template = CHAT_TEMPLATE.replace("assistant\n'", f"assistant\n{generation_prompt}'")
    template += "{# a thinking model: <think> #}"
    tokenizer = tokenizer_with(template)
    prompt = tokenizer.encode_chat(HI)
    assert tokenizer.decode(prompt).endswith("assistant\n" + generation_prompt)
    found = plan_reasoning(tokenizer, prompt, "auto")
    assert found is not None and found.starts_open is starts_open


# -- through the server, with the official clients -------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("thinker") / "model"
    write_scripted_qwen3(path, chain_of(OPEN, REASONING, CLOSE, ANSWER))
    server = ServerProcess(str(path), "--max-seqs", "2", "--max-context", "256")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture(scope="module")
def caller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("caller") / "model"
    write_scripted_qwen3(path, chain_of(OPEN, "plan", CLOSE, "<tool_call>"))
    server = ServerProcess(str(path), "--max-seqs", "2", "--max-context", "1024")
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def chat(server: ServerProcess, **fields: Any) -> Any:
    """A chat completion; streamed (``stream=True``), the list of its chunks."""
    with strict_client(server) as client:
        answer = client.chat.completions.create(
            model=server.model_name, messages=HI, max_tokens=32, temperature=0, **fields
        )
        return list(answer) if fields.get("stream") else answer


def extra(model: Any, name: str) -> Any:
    return (model.model_extra or {}).get(name)


def test_chat_returns_the_section_as_reasoning_content(thinker: ServerProcess) -> None:
    answer = chat(thinker)
    message = answer.choices[0].message
    assert extra(message, "reasoning_content") == REASONING
    assert message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == 10  # <think>, 6 letters, </think>, O, K


def test_chat_streams_the_section_as_delta_reasoning_content(thinker: ServerProcess) -> None:
    reasoning, content = [], []
    for chunk in chat(thinker, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(extra(delta, "reasoning_content") or "")
        content.append(delta.content or "")
        assert OPEN not in content[-1] and CLOSE not in content[-1]
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert sum(1 for r in reasoning if r) > 1  # streamed as it was written, not at the end


def test_reasoning_format_none_keeps_the_section_inline(thinker: ServerProcess) -> None:
    inline = f"{OPEN}{REASONING}{CLOSE}{ANSWER}"
    message = chat(thinker, extra_body={"reasoning_format": "none"}).choices[0].message
    assert message.content == inline and extra(message, "reasoning_content") is None
    streamed = chat(thinker, stream=True, extra_body={"reasoning_format": "none"})
    chunks = [chunk.choices[0].delta for chunk in streamed]
    assert "".join(d.content or "" for d in chunks) == inline
    assert not any(extra(d, "reasoning_content") for d in chunks)


def test_enable_thinking_reaches_the_template(thinker: ServerProcess) -> None:
    thinking = chat(thinker).usage.prompt_tokens
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    closed = chat(thinker, extra_body=off).usage.prompt_tokens
    assert closed == thinking + 6  # <think> \n \n </think> \n \n
    tokenized = httpx.post(thinker.url + "/tokenize", json={"messages": HI, **off}).json()
    assert tokenized["count"] == closed
    refused = httpx.post(
        thinker.url + "/v1/chat/completions",
        json={"model": thinker.model_name, "messages": HI, "chat_template_kwargs": {"tools": []}},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"


def test_responses_returns_a_reasoning_item(thinker: ServerProcess) -> None:
    with strict_client(thinker) as client:
        response = client.responses.create(
            model=thinker.model_name, input="hi", max_output_tokens=32, temperature=0
        )
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.content is not None and reasoning.content[0].text == REASONING
        assert response.output_text == ANSWER
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == 8  # the tags too
        with client.responses.stream(
            model=thinker.model_name, input="hi", max_output_tokens=32, temperature=0
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING  # type: ignore[union-attr, index]
    assert final.output_text == ANSWER


def test_messages_returns_a_thinking_block(thinker: ServerProcess) -> None:
    with anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0) as client:
        fields: dict[str, Any] = {"model": thinker.model_name, "max_tokens": 32, "messages": HI}
        message = client.messages.create(**fields)  # the chain is certain at any temperature
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == REASONING  # type: ignore[union-attr]
        assert message.content[1].text == ANSWER  # type: ignore[union-attr]
        with client.messages.stream(**fields) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == REASONING  # type: ignore[union-attr]
        assert final.content[1].text == ANSWER  # type: ignore[union-attr]
        assert "thinking" in kinds or "content_block_delta" in kinds
        disabled = client.messages.count_tokens(
            model=thinker.model_name, messages=HI, thinking={"type": "disabled"}
        )
        assert disabled.input_tokens == message.usage.input_tokens + 6


def test_tool_call_after_a_thinking_section(caller: ServerProcess) -> None:
    with strict_client(caller) as client:
        fields: dict[str, Any] = {
            "model": caller.model_name,
            "messages": HI,
            "tools": [WEATHER],
            "parallel_tool_calls": False,
            "max_tokens": 128,
            "temperature": 0,
        }
        answer = client.chat.completions.create(**fields)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert extra(choice.message, "reasoning_content") == "plan"
        assert not choice.message.content
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)  # type: ignore[union-attr]
        reasoning, names, arguments, finishes = [], [], [], []
        for chunk in client.chat.completions.create(**fields, stream=True):
            delta = chunk.choices[0].delta
            reasoning.append(extra(delta, "reasoning_content") or "")
            assert not delta.content
            for part in delta.tool_calls or []:
                function = part.function
                names.append(function.name if function and function.name else "")
                arguments.append(function.arguments if function and function.arguments else "")
            finishes.append(chunk.choices[0].finish_reason)
        assert "".join(reasoning) == "plan" and "".join(names) == "get_weather"
        assert "".join(arguments) == call.function.arguments  # type: ignore[union-attr]
        assert finishes[-1] == "tool_calls"
        response = client.responses.create(
            model=caller.model_name,
            input="hi",
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
            parallel_tool_calls=False,
            max_output_tokens=128,
            temperature=0,
        )
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[1].arguments == call.function.arguments  # type: ignore[union-attr]


def test_server_flag_keeps_reasoning_inline(tmp_path: Path) -> None:
    path = write_scripted_qwen3(tmp_path / "model", chain_of(OPEN, REASONING, CLOSE, ANSWER))
    server = ServerProcess(str(path), "--max-context", "256", "--reasoning-format", "none")
    try:
        message = chat(server).choices[0].message
        assert message.content == f"{OPEN}{REASONING}{CLOSE}{ANSWER}"
        asked = chat(server, extra_body={"reasoning_format": "auto"}).choices[0].message
        assert extra(asked, "reasoning_content") == REASONING and asked.content == ANSWER
    finally:
        assert server.stop() == 0
