"""Every chat, from any API, reaches the engine through one function,
`chat.run.start_chat` (issue 51): OpenAI's chat completions (plain, streamed, n > 1, with
tools, with a thinking section, with structured output), Anthropic's Messages and the
Responses API, each sent by its official client. `start_chat` is wrapped wherever the
server's modules hold it, and `Engine.submit` is watched: each chat calls `start_chat`
exactly once, plans its tools once, and every choice it submits is submitted from inside
that call. A text completion is the counterpoint: it never goes through `start_chat`.

In-process (no port): the app around `scripted_model`'s tiny thinking Qwen3, whose greedy
reply is ``<think>why</think>OK``; the clients talk to it through a `TestClient`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.server import create_app
from slotserve.server.chat import run as chat_run
from slotserve.server.chat import tools
from slotserve.server.chat.reasoning import CLOSE, OPEN
from tests.server.scripted_model import CONTEXT, chain_of, write_scripted_qwen3

NAME = "thinker"
HI: Any = [{"role": "user", "content": "hi"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


@dataclass
class Served:
    client: TestClient
    engine: ss.Engine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("one-chat-path") / "model"
    write_scripted_qwen3(path, chain_of(OPEN, "why", CLOSE, "OK"))
    engine = ss.Engine(ss.load(path), ss.EngineConfig(max_seqs=2, max_context=CONTEXT))
    with TestClient(create_app(engine, NAME)) as client:
        yield Served(client, engine)
    engine.close()


@dataclass
class Watched:
    """What one request did: the ``param`` of each `start_chat` call, the tool plans made,
    and the engine submits made inside and outside a `start_chat` call."""

    chats: list[str] = field(default_factory=list)
    plans: int = 0
    inside: int = 0
    outside: int = 0
    running: bool = False


def _replace_everywhere(monkeypatch: pytest.MonkeyPatch, real: object, wrapper: object) -> int:
    """Put ``wrapper`` in place of ``real`` in every loaded server module that holds it (its
    own module and every one that imported it by name); how many modules held it."""
    held = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("slotserve.server") and module is not None:
            for attribute, value in list(vars(module).items()):
                if value is real:
                    monkeypatch.setattr(module, attribute, wrapper)
                    held += 1
    return held


@pytest.fixture
def watched(served: Served, monkeypatch: pytest.MonkeyPatch) -> Watched:
    seen = Watched()
    real_start, real_plan, real_submit = chat_run.start_chat, tools.plan_tools, served.engine.submit

    async def start_chat(*args: Any, **kwargs: Any) -> chat_run.ChatRun:
        param = kwargs.get("param", args[4] if len(args) > 4 else "messages")
        seen.chats.append(param)
        seen.running = True
        try:
            return await real_start(*args, **kwargs)
        finally:
            seen.running = False

    def plan_tools(*args: Any, **kwargs: Any) -> tools.ToolPlan | None:
        seen.plans += 1
        return real_plan(*args, **kwargs)

    def submit(*args: Any, **kwargs: Any) -> ss.RequestHandle:
        if seen.running:
            seen.inside += 1
        else:
            seen.outside += 1
        return real_submit(*args, **kwargs)

    # The OpenAI, Anthropic and Responses modules each hold start_chat, and chat.run itself.
    assert _replace_everywhere(monkeypatch, real_start, start_chat) >= 4
    assert _replace_everywhere(monkeypatch, real_plan, plan_tools) >= 2  # tools, chat.run
    monkeypatch.setattr(served.engine, "submit", submit)
    return seen


def _openai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served.client.base_url}/v1",
        api_key="unused",
        http_client=served.client,
        max_retries=0,
        _strict_response_validation=True,
    )


def _anthropic(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=str(served.client.base_url),
        api_key="unused",
        http_client=served.client,
        max_retries=0,
    )


def chat_plain(served: Served) -> None:
    reply = _openai(served).chat.completions.create(
        model=NAME, messages=HI, max_tokens=16, extra_body={"reasoning_format": "none"}
    )
    assert reply.choices[0].message.content == f"{OPEN}why{CLOSE}OK"


def chat_streamed(served: Served) -> None:
    stream = _openai(served).chat.completions.create(
        model=NAME,
        messages=HI,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"reasoning_format": "none"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == f"{OPEN}why{CLOSE}OK"


def chat_two_choices(served: Served) -> None:
    reply = _openai(served).chat.completions.create(
        model=NAME, messages=HI, max_tokens=16, n=2, extra_body={"reasoning_format": "none"}
    )
    assert [c.message.content for c in reply.choices] == [f"{OPEN}why{CLOSE}OK"] * 2


def chat_reasoning(served: Served) -> None:
    reply = _openai(served).chat.completions.create(model=NAME, messages=HI, max_tokens=16)
    message = reply.choices[0].message
    assert message.content == "OK"
    assert message.model_extra == {"reasoning_content": "why"}


def chat_tools_streamed(served: Served) -> None:
    stream = _openai(served).chat.completions.create(
        model=NAME, messages=HI, max_tokens=16, tools=[WEATHER], stream=True
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] is not None


def chat_structured(served: Served) -> None:
    reply = _openai(served).chat.completions.create(
        model=NAME, messages=HI, max_tokens=4, response_format={"type": "json_object"}
    )
    assert reply.choices[0].message.content is not None


def anthropic_message(served: Served) -> None:
    message = _anthropic(served).messages.create(model=NAME, max_tokens=16, messages=HI)
    assert [block.type for block in message.content] == ["thinking", "text"]


def anthropic_streamed(served: Served) -> None:
    fields: dict[str, Any] = {"model": NAME, "max_tokens": 16, "messages": HI}
    with _anthropic(served).messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]


def responses_create(served: Served) -> None:
    response = _openai(served).responses.create(model=NAME, input="hi", max_output_tokens=16)
    assert response.output_text == "OK"


def responses_streamed(served: Served) -> None:
    with _openai(served).responses.stream(model=NAME, input="hi", max_output_tokens=16) as stream:
        final = stream.get_final_response()
    assert final.output_text == "OK"


# Each sender, the field its messages came in (start_chat's ``param``) and its choices.
CHATS: list[tuple[Callable[[Served], None], str, int]] = [
    (chat_plain, "messages", 1),
    (chat_streamed, "messages", 1),
    (chat_two_choices, "messages", 2),
    (chat_reasoning, "messages", 1),
    (chat_tools_streamed, "messages", 1),
    (chat_structured, "messages", 1),
    (anthropic_message, "messages", 1),
    (anthropic_streamed, "messages", 1),
    (responses_create, "input", 1),
    (responses_streamed, "input", 1),
]


@pytest.mark.parametrize(("send", "param", "choices"), CHATS, ids=[c[0].__name__ for c in CHATS])
def test_every_chat_reaches_the_engine_through_start_chat(
    served: Served, watched: Watched, send: Callable[[Served], None], param: str, choices: int
) -> None:
    send(served)
    assert watched.chats == [param]  # start_chat, exactly once
    assert watched.plans == 1  # its tools planned once
    assert (watched.inside, watched.outside) == (choices, 0)  # every choice submitted there


def test_a_text_completion_does_not_take_the_chat_path(served: Served, watched: Watched) -> None:
    reply = _openai(served).completions.create(model=NAME, prompt="hi", max_tokens=4)
    assert reply.choices[0].text is not None
    assert watched.chats == [] and watched.plans == 0
    assert (watched.inside, watched.outside) == (0, 1)
