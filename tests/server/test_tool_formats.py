"""Tool-call syntaxes without a server: the grammar every call is decoded under (driven by a
random walk over the tokens it allows, as a random model would), reading calls back whole
and as they stream, and which syntax a chat template writes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from slotserve.engine import TokenEvent
from slotserve.sampling import Grammar, GrammarCompiler
from slotserve.server.chat.reply import CallStream, ReplyShape, read_reply
from slotserve.server.chat.tool_formats import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    SYNTAXES,
    CallSyntax,
    call_grammar,
    scan,
    template_syntax,
)
from slotserve.server.chat.tools import takes_tools
from slotserve.testing import CHAT_TEMPLATE, TINY_VOCAB, tiny_tokenizer
from slotserve.tokenizer import Tokenizer

EOS = 2
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"enum": [1, 2, 3]}},
    "required": ["city"],
    "additionalProperties": False,
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
FUNCTIONS = [("get_weather", CITY), ("noop", NOTHING)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[EOS], chat_template=None)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, TINY_VOCAB)


def walk(
    grammar: Grammar, tokenizer: Tokenizer, seed: int, start: str = "", limit: int = 3000
) -> list[int]:
    """Tokens a random model would write under ``grammar`` after ``start``: each drawn
    uniformly from those it allows, ending (half the time, when it may) on end-of-sequence."""
    rng = np.random.default_rng(seed)
    matcher = grammar.matcher(TINY_VOCAB)
    tokens = tokenizer.encode(start) if start else []
    for token in tokens:
        matcher.accept(token)
    for _ in range(limit):
        allowed = np.flatnonzero(matcher.allowed().numpy())
        others = allowed[allowed != EOS]
        if EOS in allowed and (not others.size or rng.random() < 0.5):
            return tokens
        token = int(rng.choice(others))
        assert matcher.error is None
        matcher.accept(token)
        tokens.append(token)
    raise AssertionError(f"no end within {limit} tokens: {tokenizer.decode(tokens)[:200]!r}")


def calls_of(syntax: CallSyntax, text: str) -> list[tuple[str, Any]]:
    found = scan(syntax, text, final=True)
    assert not found.broken and found.closed, text
    assert all(call.complete for call in found.calls)
    return [(str(call.name), json.loads(call.arguments)) for call in found.calls]


@pytest.mark.parametrize("name", sorted(SYNTAXES))
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate(
    compiler: GrammarCompiler, tokenizer: Tokenizer, name: str, parallel: bool
) -> None:
    syntax = SYNTAXES[name]
    grammar = compiler.compile(
        call_grammar(syntax, FUNCTIONS, mode="required", parallel=parallel), "calls"
    )
    counts = set()
    for seed in range(6):
        text = tokenizer.decode(walk(grammar, tokenizer, seed))
        calls = calls_of(syntax, text)
        counts.add(len(calls))
        for function, arguments in calls:
            jsonschema.validate(arguments, dict(FUNCTIONS)[function])
    assert min(counts) >= 1
    if not parallel or syntax.max_calls == 1:
        assert counts == {1}


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL, LLAMA3], ids=lambda s: s.name)
def test_auto_keeps_free_text_free_until_the_trigger(
    compiler: GrammarCompiler, tokenizer: Tokenizer, syntax: CallSyntax
) -> None:
    grammar = compiler.compile(call_grammar(syntax, FUNCTIONS, mode="auto", parallel=True), "a")
    matcher = grammar.matcher(TINY_VOCAB)
    for token in tokenizer.encode("Free text: {} [] <tool> anything"):
        assert matcher.allowed()[token]
        matcher.accept(token)
    assert matcher.allowed()[EOS]  # a reply may end without calling
    # Once the trigger is written, the call follows the grammar.
    text = tokenizer.decode(walk(grammar, tokenizer, 3, start="I will call. " + syntax.trigger))
    assert text.startswith("I will call. ")
    (function, arguments), *_ = calls_of(syntax, text)
    jsonschema.validate(arguments, dict(FUNCTIONS)[function])
    assert scan(syntax, text, final=True).content == "I will call. "


def test_generic_auto_is_a_call_or_a_json_content_reply(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    grammar = compiler.compile(call_grammar(GENERIC, FUNCTIONS, mode="auto", parallel=True), "g")
    kinds = set()
    for seed in range(12):
        text = tokenizer.decode(walk(grammar, tokenizer, seed, limit=6000))
        found = scan(GENERIC, text, final=True)
        kinds.add("calls" if found.calls else "content")
        if not found.calls:
            assert json.loads(text) == {"content": found.content}
    assert kinds == {"calls", "content"}


def test_a_special_token_trigger_is_written_as_that_token(compiler: GrammarCompiler) -> None:
    backend = tiny_tokenizer()
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    special = backend.token_to_id("[TOOL_CALLS]")
    tokenizer = Tokenizer(backend, bos_id=None, eos_ids=[EOS], chat_template=None)
    own = GrammarCompiler(tokenizer, TINY_VOCAB)
    specials = {"[TOOL_CALLS]": special}
    text = call_grammar(MISTRAL, FUNCTIONS, mode="required", parallel=True, specials=specials)
    assert f"<[{special}]>" in text
    tokens = walk(own.compile(text, "calls"), tokenizer, 0)
    assert tokens[0] == special
    # The engine's text leaves special tokens out; the reply's text gets it back.
    events = [
        TokenEvent(t, tokenizer.decode([t], skip_special=True), i, 0.0)
        for i, t in enumerate(tokens)
    ]
    text = "".join(ReplyShape(markers={special: "[TOOL_CALLS]"}).text(e) for e in events)
    assert calls_of(MISTRAL, text)
    shape = ReplyShape(MISTRAL, markers={special: "[TOOL_CALLS]"})
    read = [(name, json.loads(arguments)) for name, arguments in read_reply(shape, events).calls]
    assert read == calls_of(MISTRAL, text)


# -- reading calls back, whole and streamed ---------------------------------------------

CALLS = [("get_weather", '{"city": "Pa\\"ris", "days": 2}'), ("noop", "{}")]


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_streamed_calls_rebuild_the_whole(name: str) -> None:
    syntax = SYNTAXES[name]
    calls = CALLS[: syntax.max_calls]
    text = ("Let me look. " if syntax is not GENERIC else "") + syntax.calls_text(calls)
    stream = CallStream(syntax)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.push("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    announced: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(announced) and call["function"]["arguments"] == ""
                announced.append(call)
            arguments[call["index"]] = arguments.get(call["index"], "") + call["function"].get(
                "arguments", ""
            )
    assert content == ("Let me look. " if syntax is not GENERIC else "")
    assert [c["function"]["name"] for c in announced] == [n for n, _ in calls]
    assert [arguments[i] for i in range(len(calls))] == [a for _, a in calls]
    assert len({c["id"] for c in announced}) == len(calls)
    assert calls_of(syntax, text) == [(n, json.loads(a)) for n, a in calls]


def test_content_that_may_begin_the_trigger_is_held_back() -> None:
    stream = CallStream(HERMES)
    assert stream.push("Hello <tool") == [{"content": "Hello "}]
    assert stream.push("box>") == [{"content": "<toolbox>"}]
    assert stream.push(" <", final=True) == [{"content": " <"}]


def test_generic_content_reply_streams_decoded() -> None:
    text = json.dumps({"content": 'say "hé" \\ 😀 done'})
    stream = CallStream(GENERIC)
    content = "".join(d.get("content", "") for ch in text for d in stream.push(ch))
    assert content == 'say "hé" \\ 😀 done' and not stream.called


def test_text_the_grammar_did_not_write_is_broken() -> None:
    assert scan(HERMES, "<tool_call>\nnot json", final=True).broken
    assert not scan(HERMES, "<tool_call>\n{", final=False).broken


def test_template_syntax() -> None:
    hermes = "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>"
    assert takes_tools(hermes) and template_syntax(hermes, True) is HERMES
    mistral = "{% for t in tools %}{% endfor %}[TOOL_CALLS]"
    assert template_syntax(mistral, takes_tools(mistral)) is MISTRAL
    llama = '{{ tools }}<|start_header_id|>{"name": ..., "parameters": ...}'
    assert template_syntax(llama, takes_tools(llama)) is LLAMA3
    assert not takes_tools(CHAT_TEMPLATE) and template_syntax(CHAT_TEMPLATE, False) is None
    assert template_syntax("{{ tools }} some other syntax", True) is None  # generic instead


# -- property: any parameters schema, any syntax: the arguments validate ----------------

_NAMES = st.from_regex(r"[a-z]{1,5}", fullmatch=True)
_SCALARS = st.one_of(
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-c]{1,3}$", "^[0-9]{2}$"])
    ),
    st.lists(
        st.sampled_from(["a", "red", "x y", 3, True]), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def with_required(properties: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        keys = sorted(properties)
        required = st.lists(st.sampled_from(keys), unique=True) if keys else st.just([])
        return required.map(
            lambda names: {
                "type": "object",
                "properties": properties,
                "required": names,
                "additionalProperties": False,
            }
        )

    return st.dictionaries(_NAMES, children, max_size=3).flatmap(with_required)


_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        _objects(children),
        st.builds(
            lambda items, most: {"type": "array", "items": items, "maxItems": most},
            children,
            st.integers(0, 3),
        ),
    ),
    max_leaves=6,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parameters=_objects(_VALUES),
    name=st.sampled_from(sorted(SYNTAXES)),
    parallel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_call_validates_against_its_schema(
    compiler: GrammarCompiler,
    tokenizer: Tokenizer,
    parameters: dict[str, Any],
    name: str,
    parallel: bool,
    seed: int,
) -> None:
    syntax = SYNTAXES[name]
    functions = [("tool_a", parameters), ("tool_b", NOTHING)]
    grammar = compiler.compile(
        call_grammar(syntax, functions, mode="required", parallel=parallel), "calls"
    )
    text = tokenizer.decode(walk(grammar, tokenizer, seed))
    calls = calls_of(syntax, text)
    assert calls
    for function, arguments in calls:
        jsonschema.validate(arguments, dict(functions)[function])
