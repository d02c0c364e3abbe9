"""A Responses custom tool's regular expression (`responses.custom`) holds inside the model's
call: the call grammar of a reply that must call the tool (`tool_formats.call_grammar`,
the generic syntax, the tool's arguments schema `input_schema`), compiled for the tiny
vocabulary and walked at random to end-of-sequence, reads back (`chat.reply.parse_reply`,
`input_of`) as an input the regular expression matches whole, for regular expressions
hypothesis draws over an alphabet that JSON must escape (a quote, a backslash, a newline,
a tab). `input_of` is also checked on every prefix of a call's arguments: what it reads is
a prefix of the whole input, never a broken escape. A Lark grammar's call (its rules
escaped, `responses.custom.lark_arguments`) walked so reads back as an input in the
grammar's language, for grammars `test_lark_json` draws."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.sampling import GrammarCompiler, GrammarError
from slotserve.server.chat.reply import parse_reply
from slotserve.server.chat.tool_formats import GENERIC, call_grammar
from slotserve.server.responses.custom import (
    call_arguments,
    input_of,
    input_schema,
    lark_arguments,
)
from slotserve.testing import TINY_VOCAB, tiny_tokenizer
from slotserve.tokenizer import Tokenizer
from tests.test_grammar_property import random_walk
from tests.test_lark_json import Grammar, grammars, in_language

EOS = 2  # the tiny vocabulary's end-of-sequence (as in test_grammar_property)
WALK_TOKENS = 160
_ALPHABET = 'ab1"\\\n\t'


def _char(ch: str) -> str:
    """One character as a regular expression both Python's and Rust's read alike."""
    return f"\\x{ord(ch):02x}"


EXPRESSIONS = st.recursive(
    st.text(_ALPHABET, min_size=1, max_size=3).map(lambda s: "".join(map(_char, s))),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from("?*+")).map(lambda p: f"(?:{p[0]}){p[1]}"),
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[EOS], chat_template=None)
    return GrammarCompiler(tokenizer, TINY_VOCAB)


def _tool(regex: str) -> dict[str, Any]:
    form = {"type": "grammar", "syntax": "regex", "definition": regex}
    return {"type": "custom", "name": "run", "format": form}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=EXPRESSIONS, seed=st.integers(0, 2**32 - 1))
def test_a_custom_call_input_matches_its_regex(
    compiler: GrammarCompiler, regex: str, seed: int
) -> None:
    schema = input_schema(_tool(regex), 0)
    text = call_grammar(GENERIC, [("run", schema)], mode="required", parallel=False)
    try:
        grammar = compiler.compile(text, "custom tool")
    except GrammarError:
        pytest.fail(f"every drawn expression admits a string, yet {regex!r} was refused")
    given_input = walked_input(compiler, grammar, seed, cut_ok=False)
    if given_input is not None:
        assert re.fullmatch(regex, given_input), (regex, given_input)


def walked_input(compiler: GrammarCompiler, grammar: Any, seed: int, *, cut_ok: bool) -> str | None:
    """The input of the one call ``run`` a random walk of the call grammar writes (up to
    three walks; None when none ends within its budget). ``cut_ok``: a walk whose call was
    cut (deep nesting ran into llguidance's item limit: not a whole call) is walked again
    rather than failed."""
    for attempt in range(3):
        tokens = random_walk(compiler, grammar, seed + attempt, budget=WALK_TOKENS, strict=True)
        if tokens is None:
            continue
        reply = compiler.tokenizer.decode(tokens[:-1])
        content, calls, cut = parse_reply(GENERIC, reply)
        if cut and cut_ok:
            continue
        assert content == "" and not cut and [name for name, _ in calls] == ["run"], reply
        given_input = input_of(calls[0][1])
        assert json.loads(calls[0][1]) == {"input": given_input}
        return given_input
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=grammars(), seed=st.integers(0, 2**32 - 1))
def test_a_custom_call_input_parses_under_its_lark_grammar(
    compiler: GrammarCompiler, drawn: Grammar, seed: int
) -> None:
    form = {"type": "grammar", "syntax": "lark", "definition": drawn.lark()}
    arguments = lark_arguments([{"type": "custom", "name": "run", "format": form}])
    text = call_grammar(GENERIC, list(arguments.items()), mode="required", parallel=False)
    try:
        grammar = compiler.compile(text, "custom tool")
    except GrammarError:
        return  # a language without a string (its recursion never ends)
    given_input = walked_input(compiler, grammar, seed, cut_ok=True)
    if given_input is not None:
        assert in_language(drawn, given_input), (drawn.lark(), given_input)
        return


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=12))
def test_input_of_every_prefix_is_a_prefix_of_the_input(text: str) -> None:
    arguments = call_arguments(text)
    assert input_of(arguments) == text
    for end in range(len(arguments)):
        assert text.startswith(input_of(arguments[:end]))
