"""The official openai client, strict response validation, against a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess


def chat(client: openai.OpenAI, model: str, **kwargs: object) -> object:
    messages = [{"role": "user", "content": "hello there"}]
    return client.chat.completions.create(model=model, messages=messages, **kwargs)  # type: ignore[call-overload]


def test_models(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_server.model_name]
    assert client.models.retrieve(tiny_server.model_name).id == tiny_server.model_name


def test_chat_completion(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    result = chat(client, tiny_server.model_name, max_tokens=8, temperature=0)
    choice = result.choices[0]  # type: ignore[attr-defined]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = result.usage  # type: ignore[attr-defined]
    assert usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    stream = chat(
        client,
        tiny_server.model_name,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    full = chat(client, tiny_server.model_name, max_tokens=8, temperature=0)
    assert text == full.choices[0].message.content  # type: ignore[attr-defined]


def lenient_client(server: ServerProcess) -> openai.OpenAI:
    """A client with the default (non-strict) response validation."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_and_stream(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    result = client.completions.create(
        model=tiny_server.model_name, prompt="abc", max_tokens=6, temperature=0
    )
    # Legacy completion chunks carry finish_reason null until the last one (as OpenAI's own
    # API sends them), which the client's strict Completion type rejects: read the stream
    # with default validation.
    lenient = lenient_client(tiny_server)
    streamed = lenient.completions.create(
        model=tiny_server.model_name, prompt="abc", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == result.choices[0].text
    ids = httpx.post(tiny_server.url + "/tokenize", json={"text": "abc"}).json()["tokens"]
    tokens = client.completions.create(
        model=tiny_server.model_name, prompt=ids, max_tokens=6, temperature=0
    )
    assert tokens.choices[0].text == result.choices[0].text


def test_n_choices(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    result = chat(client, tiny_server.model_name, max_tokens=6, n=2, seed=3)
    assert sorted(c.index for c in result.choices) == [0, 1]  # type: ignore[attr-defined]
    stream = chat(client, tiny_server.model_name, max_tokens=6, n=2, seed=3, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}  # type: ignore[attr-defined]
    assert finished == {0, 1}


def test_seed_reproduces(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    texts = {
        chat(client, tiny_server.model_name, max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .message.content  # type: ignore[attr-defined]
        for _ in range(3)
    }
    assert len(texts) == 1


def test_stop_strings(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    free = chat(client, tiny_server.model_name, max_tokens=20, temperature=0)
    text = free.choices[0].message.content  # type: ignore[attr-defined]
    stop = text[4:6]
    stopped = chat(client, tiny_server.model_name, max_tokens=20, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"  # type: ignore[attr-defined]
    assert stopped.choices[0].message.content == text[: text.index(stop)]  # type: ignore[attr-defined]


def test_logprobs(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    result = chat(
        client, tiny_server.model_name, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = result.choices[0].logprobs.content  # type: ignore[attr-defined]
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy = top-1
    text = client.completions.create(
        model=tiny_server.model_name, prompt="abc", max_tokens=3, temperature=0, logprobs=2
    )
    assert len(text.choices[0].logprobs.token_logprobs) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 100}, "n"),
    ],
)
def test_bad_parameters_are_400(
    client: openai.OpenAI, tiny_server: ServerProcess, kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, tiny_server.model_name, **kwargs)
    assert needle in str(err.value)


def test_messages_not_a_list(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=tiny_server.model_name, messages="hi")  # type: ignore[arg-type]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat(client, "gpt-5")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")


def test_context_too_long_is_400(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="max_context=256") as err:
        client.completions.create(model=tiny_server.model_name, prompt="x" * 300, max_tokens=4)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


def test_echo_streams_the_prompt_first(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    lenient = lenient_client(tiny_server)  # legacy chunks: see test_completion_and_stream
    whole = client.completions.create(
        model=tiny_server.model_name, prompt="abc", max_tokens=4, temperature=0, echo=True
    )
    streamed = lenient.completions.create(
        model=tiny_server.model_name,
        prompt="abc",
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith("abc")
