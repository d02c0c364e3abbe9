"""``/v1/embeddings`` with the official openai client (strict) against a real server on the
tiny model: text, token and batched inputs, float and base64, refusals naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from slotserve.testing import write_tiny_gguf
from tests.server.conftest import ServerProcess

TEXTS = ["the cat sat", "on the mat", "x"]


def vectors(result: object) -> np.ndarray:
    return np.array([item.embedding for item in result.data])  # type: ignore[attr-defined]


def floats(client: openai.OpenAI, model: str, **kwargs: object) -> object:
    return client.embeddings.create(model=model, encoding_format="float", **kwargs)  # type: ignore[call-overload]


def test_embeddings(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    model = tiny_server.model_name
    batched = floats(client, model, input=TEXTS)
    assert [item.index for item in batched.data] == [0, 1, 2]  # type: ignore[attr-defined]
    found = vectors(batched)
    assert found.shape == (3, 64)
    np.testing.assert_allclose(np.linalg.norm(found, axis=1), 1.0, atol=1e-5)
    # The client's default asks for base64 and decodes it after parsing the response, which
    # its strict validation (a list of floats) would refuse first: read it leniently.
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as lenient:
        encoded = lenient.embeddings.create(model=model, input=TEXTS)
    np.testing.assert_allclose(vectors(encoded), found, atol=1e-6)
    alone = np.concatenate([vectors(floats(client, model, input=t)) for t in TEXTS])
    np.testing.assert_allclose(alone, found, atol=1e-6)
    ids = httpx.post(tiny_server.url + "/tokenize", json={"text": TEXTS[0]}).json()["tokens"]
    tokens = floats(client, model, input=[ids])
    np.testing.assert_allclose(vectors(tokens)[0], found[0], atol=1e-6)
    usage = batched.usage  # type: ignore[attr-defined]
    assert usage.prompt_tokens == sum(len(t.encode()) for t in TEXTS)  # byte tokens
    assert usage.total_tokens == usage.prompt_tokens


def test_last_token_pooling_differs(client: openai.OpenAI, tiny_server: ServerProcess) -> None:
    model = tiny_server.model_name
    mean = vectors(floats(client, model, input="hello world"))
    last = floats(client, model, input="hello world", extra_body={"pooling": "last"})
    assert np.abs(vectors(last) - mean).max() > 1e-3


def test_the_ggufs_pooling_type_is_the_default(tmp_path: Path) -> None:
    """A GGUF that names its pooling (``llama.pooling_type`` 3: last token) is pooled that
    way unless the request says otherwise."""
    gguf = write_tiny_gguf(tmp_path / "last.gguf", "llama", pooling_type=3)
    server = ServerProcess(str(gguf), "--max-seqs", "2", "--max-context", "64")
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            model = server.model_name
            default = vectors(floats(client, model, input="hello world"))
            last = floats(client, model, input="hello world", extra_body={"pooling": "last"})
            mean = floats(client, model, input="hello world", extra_body={"pooling": "mean"})
        np.testing.assert_array_equal(default, vectors(last))
        assert np.abs(default - vectors(mean)).max() > 1e-3
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "changes,param",
    [
        ({"dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": [[5, 999999]]}, "input"),
        ({"input": "x" * 300}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    tiny_server: ServerProcess, changes: dict[str, object], param: str
) -> None:
    body = {"model": tiny_server.model_name, "input": "hi", **changes}
    response = httpx.post(tiny_server.url + "/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")
