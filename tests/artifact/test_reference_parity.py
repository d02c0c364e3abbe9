"""The bundled model against llama.cpp (tests/data/llamacpp_greedy.json, see its meta):
the chat template and tokenisation, and the agreement targets of `tests.artifact.parity`
with the default fp16 KV and with fp32 KV, on the dequantised weights and on the file's own
blocks."""

from __future__ import annotations

from typing import Any

import pytest

import slotserve as ss
from tests.artifact.parity import check
from tests.artifact.test_gguf_parity import KV_DTYPES


def test_chat_template_renders_the_reference_prompt(
    bundled: ss.Model, reference: dict[str, Any]
) -> None:
    chats = [c for c in reference["cases"] if c["kind"] == "chat"]
    assert chats
    for case in chats:
        messages = [{"role": "user", "content": case["user_text"]}]
        assert bundled.tokenizer.render_chat(messages) == case["prompt"]


def test_tokenisation_matches_llama_cpp(bundled: ss.Model, reference: dict[str, Any]) -> None:
    assert reference["meta"]["add_bos"] is False
    for case in reference["cases"]:
        assert bundled.tokenizer.encode(case["prompt"]) == case["prompt_tokens"], case["prompt"]


@pytest.fixture(scope="module")
def bundled_blocks() -> ss.Model:
    """The bundled model as it serves by default: the file's Q4_1 blocks, fused halves."""
    return ss.load("bundled", progress=False)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_teacher_forced_argmax_matches_llama_cpp(bundled: ss.Model, kv_dtype: str) -> None:
    """The dequantised fp32 weights (the `bundled` fixture)."""
    check(bundled, "llamacpp_greedy.json", kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_served_blocks_match_llama_cpp(bundled_blocks: ss.Model, kv_dtype: str) -> None:
    assert bundled_blocks.halves.kind == "block"
    check(bundled_blocks, "llamacpp_greedy.json", kv_dtype)


def test_bundled_metadata(bundled: ss.Model) -> None:
    info = bundled.info
    assert (info.arch, info.n_layers, info.dim, info.n_heads, info.n_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert info.tied_embeddings and info.eos_ids == (2,) and info.vocab_size == 49152
    assert 130e6 < bundled.weights.n_params < 140e6
