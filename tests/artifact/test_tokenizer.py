"""Tokenizer round trips and streaming detokenisation on the bundled model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss

TEXTS = [
    "Hello, world! How are you today?",
    "Größenordnung, façade, naïve café — déjà vu.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Emoji: 👩‍👩‍👧‍👦 🇫🇷 🤖🔥 and ZWJ sequences ✌🏽",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\t# tab\r\n",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "   leading spaces and trailing   ",
    "numbers 1234567890 3.14159 -42 1e-9",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(bundled: ss.Model, text: str) -> None:
    tokenizer = bundled.tokenizer
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_detokenisation_concatenates_to_full_decode(bundled: ss.Model, text: str) -> None:
    tokenizer = bundled.tokenizer
    stream = tokenizer.stream_decoder()
    pieces = [stream.push(token) for token in tokenizer.encode(text)]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


# SmolLM2's byte-level vocabulary has no token for a few control bytes nor for the lead
# bytes 0xF1/0xF2/0xF5-0xFF, so text in planes 4-15 or with those control characters cannot
# be encoded by this model (llama.cpp included); the property covers everything else.
REPRESENTABLE = st.characters(
    max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc"), include_characters="\n\t\r"
)


@settings(max_examples=60, deadline=None)
@given(st.text(REPRESENTABLE, min_size=1, max_size=40))
def test_round_trip_property(bundled: ss.Model, text: str) -> None:
    tokenizer = bundled.tokenizer
    ids = tokenizer.encode(text)
    stream = tokenizer.stream_decoder(skip_special=False)
    streamed = "".join(stream.push(t) for t in ids) + stream.flush()
    assert tokenizer.decode(ids) == text
    assert streamed == text


def test_special_tokens_are_parsed(bundled: ss.Model) -> None:
    ids = bundled.tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert bundled.tokenizer.is_special(1) and not bundled.tokenizer.is_special(504)


def test_serialised_tokenizer_is_identical(bundled: ss.Model) -> None:
    copy = ss.Tokenizer.from_json(bundled.tokenizer.to_json())
    for text in TEXTS:
        assert copy.encode(text) == bundled.tokenizer.encode(text)
    assert copy.chat_template == bundled.tokenizer.chat_template
