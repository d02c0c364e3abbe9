"""Property (issue 30, item 4): for every JSON schema the grammar compiler accepts, an
output the server would report as finished ("stop": ended by end-of-sequence, and the
grammar accepts it) parses and validates against the schema. A schema the grammar cannot
enforce must be refused at compile time, never half-enforced.

Schemas are built by hypothesis from leaves whose values hypothesis-jsonschema draws,
composed into objects, arrays, anyOf/allOf and $ref
definitions, self references included; outputs are random walks over each grammar's
allowed tokens on the tiny byte tokenizer, so every character the grammar allows is drawn
sooner or later. jsonschema validates.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.engine import Finished
from slotserve.engine.events import Usage
from slotserve.engine.timings import RequestTimings
from slotserve.sampling import GrammarCompiler, GrammarError
from slotserve.server.chat.structured import choice_grammar, output_refusal
from slotserve.testing import TINY_VOCAB, tiny_tokenizer
from slotserve.tokenizer import Tokenizer

hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")

EOS = 2
WALK_TOKENS = 120

_SCALAR = {"type": ["string", "integer", "boolean", "null"], "maxLength": 6}
# hypothesis-jsonschema draws every value inside the leaf schemas (its object strategy does
# not run on this hypothesis, so the leaves themselves are built here).
_from = hypothesis_jsonschema.from_schema
_BOUND = _from({"type": "integer", "minimum": -50, "maximum": 200})
_LENGTH = _from({"type": "integer", "minimum": 0, "maximum": 8})
_OPTIONAL_BOUND = st.none() | _BOUND
_OPTIONAL_LENGTH = st.none() | _LENGTH


def _given(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


LEAVES = st.one_of(
    st.builds(
        lambda low, high: _given(type="integer", minimum=low, maximum=high),
        _OPTIONAL_BOUND,
        _OPTIONAL_BOUND,
    ),
    st.builds(
        lambda low, high: _given(type="string", minLength=low, maxLength=high),
        _OPTIONAL_LENGTH,
        _OPTIONAL_LENGTH,
    ),
    st.builds(lambda kind: {"type": kind}, st.sampled_from(["boolean", "null", "number"])),
    st.builds(
        lambda values: {"enum": values},
        _from({"type": "array", "items": _SCALAR, "minItems": 1, "maxItems": 4}),
    ),
    st.builds(lambda value: {"const": value}, _from(_SCALAR)),
)
NAMES = st.sampled_from(["a", "b", "kind", "x y", "ü"])


def _composed(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    objects = st.builds(
        lambda props, required, closed: {
            "type": "object",
            "properties": props,
            "required": sorted(set(required) & set(props)),
            "additionalProperties": not closed and {"type": "integer"},
        },
        st.dictionaries(NAMES, inner, max_size=3),
        st.lists(NAMES, max_size=3),
        st.booleans(),
    )
    arrays = st.builds(
        lambda items, low, extra: {
            "type": "array",
            "items": items,
            "minItems": low,
            "maxItems": low + extra,
        },
        inner,
        st.integers(0, 1),
        st.integers(0, 2),
    )
    combined = st.builds(
        lambda key, parts: {key: parts},
        st.sampled_from(["anyOf", "allOf", "oneOf"]),
        st.lists(inner, min_size=1, max_size=3),
    )
    return st.one_of(objects, arrays, combined)


def _with_refs(body: Any, kind: str) -> Any:
    """``body`` reached through $ref: as a definition, as a recursive tree, or in loops
    the grammar cannot enforce (which must be refused)."""
    if kind == "definition":
        return {"$defs": {"d": body}, "$ref": "#/$defs/d"}
    if kind == "tree":  # recursion through an array item: enforceable
        return {
            "type": "object",
            "properties": {
                "v": body,
                "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    if kind == "self":
        return {"anyOf": [{"$ref": "#"}, body]}
    if kind == "mutual":
        loop = {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}
        return {"$defs": loop, "anyOf": [{"$ref": "#/$defs/a"}, body]}
    return body


SCHEMAS = st.builds(
    _with_refs,
    st.recursive(LEAVES, _composed, max_leaves=6),
    st.sampled_from(["plain", "plain", "definition", "tree", "self", "mutual"]),
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(tiny_tokenizer(), bos_id=None, eos_ids=[EOS], chat_template=None)
    return GrammarCompiler(tokenizer, TINY_VOCAB)


def _finished(tokens: list[int]) -> Finished:
    usage = Usage(0, len(tokens), 0)
    return Finished("stop", usage, RequestTimings(0.0), "", tuple(tokens), eos_token=EOS)


def random_walk(
    compiler: GrammarCompiler,
    grammar: Any,
    seed: int,
    *,
    budget: int = WALK_TOKENS,
    strict: bool = False,
) -> list[int] | None:
    """A random output: allowed tokens drawn uniformly, end-of-sequence half the time it is
    allowed (always when it is the only one, as the sampler does for a matcher in error);
    None if the ``budget`` of tokens ran out first (a "length" finish, claiming nothing).
    ``strict``: the matcher must never be in error (end-of-sequence allowed, or the matcher
    stopped, wherever no other token is)."""
    rng = random.Random(seed)
    matcher = grammar.matcher(TINY_VOCAB)
    tokens: list[int] = []
    for _ in range(budget):
        allowed = matcher.allowed().nonzero().flatten().tolist()
        others = [t for t in allowed if t != EOS]
        if not others or (EOS in allowed and rng.random() < 0.5):
            assert not strict or EOS in allowed or matcher.is_stopped()
            return [*tokens, EOS]
        token = rng.choice(others)
        tokens.append(token)
        matcher.accept(token)
    return None


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_a_stop_output_validates_for_every_accepted_schema(
    compiler: GrammarCompiler, schema: dict[str, Any], seed: int
) -> None:
    try:
        grammar = compiler.json_schema(schema)
    except GrammarError:
        return  # refused at compile time: never half-enforced
    for attempt in range(3):
        tokens = random_walk(compiler, grammar, seed + attempt)
        if tokens is None or output_refusal(grammar, _finished(tokens)) is not None:
            continue  # "length", or the server's 500: no "stop" is claimed
        text = compiler.tokenizer.decode(tokens[:-1])
        document = json.loads(text)
        jsonschema.validate(document, schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"allOf": [{"$ref": "#"}]},
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {
            "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2000)}
            | {"d2000": {"type": "integer"}},
            "$ref": "#/$defs/d0",
        },
    ],
    ids=["self", "allOf-self", "anyOf-self", "mutual", "chain-2000"],
)
def test_ref_schemas_the_grammar_cannot_enforce_are_refused(
    compiler: GrammarCompiler, schema: dict[str, Any]
) -> None:
    """Each of these compiled (before issue 30) into a grammar whose output ended "stop"
    with '' (no document) or that jsonschema cannot check; now each is refused, naming
    the loop or the chain."""
    with pytest.raises(GrammarError, match=r"refers to itself|\$ref chain"):
        compiler.json_schema(schema)


def test_recursion_through_an_item_is_kept(compiler: GrammarCompiler) -> None:
    schema = _with_refs({"type": "integer"}, "tree")
    grammar = compiler.json_schema(schema)
    tokens = [*compiler.tokenizer.encode('{"v": 1, "kids": [{"v": 2}]}'), EOS]
    assert output_refusal(grammar, _finished(tokens)) is None


def test_an_output_the_grammar_does_not_accept_is_never_stop(compiler: GrammarCompiler) -> None:
    """A constrained request that ended on end-of-sequence mid-document (its matcher went
    into error) is reported as the server's error, not as a finished document."""
    grammar = compiler.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    encode = compiler.tokenizer.encode
    cut = [*encode('{"a": '), EOS]
    refusal = output_refusal(grammar, _finished(cut))
    assert refusal is not None and refusal.status == 500 and refusal.code == "grammar_failed"
    assert "incomplete" in refusal.message
    assert output_refusal(grammar, _finished([*encode('{"a": 12}'), EOS])) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [9007199254740993]},
        {"const": -(2**60)},
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64}}},
        {"enum": [{"a": [1, 2**53 + 1]}]},
    ],
)
def test_an_integer_past_2_to_the_53_is_refused_naming_where(
    compiler: GrammarCompiler, schema: dict[str, Any]
) -> None:
    """llguidance reads a schema's numbers as doubles, so 2**53 + 1 would be enforced as
    2**53 (the property test above found it): refused, naming the pointer and the bound."""
    with pytest.raises(GrammarError, match=r"JSON schema at #/.*past \+-2\*\*53"):
        compiler.json_schema(schema)
    compiler.json_schema({"enum": [2**53, -(2**53)]})  # the largest exact ones compile


# -- grammars in other syntaxes (issue 53): GBNF, Lark, regular expressions, choices ---------
#
# One expression, drawn by hypothesis from literals, character classes, sequences,
# alternatives and repetitions, written three ways: as a Python regular expression (the
# oracle), as llama.cpp's GBNF, and as a regular expression for llguidance. Whatever a
# random walk over the compiled grammar ends with end-of-sequence must match the oracle.

_ALPHABET = "ab1 -."


def _literal(text: str) -> dict[str, Any]:
    return {"lit": text}


EXPRESSIONS = st.recursive(
    st.text(_ALPHABET, min_size=1, max_size=3).map(_literal)
    | st.sampled_from([{"cls": "a-b"}, {"cls": "0-9"}, {"cls": " .-"}]),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(lambda items: {"seq": items}),
        st.lists(inner, min_size=2, max_size=3).map(lambda items: {"alt": items}),
        st.tuples(inner, st.sampled_from("?*+")).map(lambda pair: {"rep": pair[0], "op": pair[1]}),
    ),
    max_leaves=6,
)


def as_regex(node: dict[str, Any]) -> str:
    if "lit" in node:
        return re.escape(node["lit"])
    if "cls" in node:
        return "[ .\\-]" if node["cls"] == " .-" else f"[{node['cls']}]"
    if "seq" in node:
        return "".join(as_regex(item) for item in node["seq"])
    if "alt" in node:
        return "(?:" + "|".join(as_regex(item) for item in node["alt"]) + ")"
    return "(?:" + as_regex(node["rep"]) + ")" + node["op"]


def as_gbnf(node: dict[str, Any]) -> str:
    if "lit" in node:
        return json.dumps(node["lit"])
    if "cls" in node:  # a dash before the closing bracket is itself, as in a regex
        return f"[{node['cls']}]"
    if "seq" in node:
        return " ".join(as_gbnf(item) for item in node["seq"])
    if "alt" in node:
        return "(" + " | ".join(as_gbnf(item) for item in node["alt"]) + ")"
    return "(" + as_gbnf(node["rep"]) + ")" + node["op"]


def _walk_text(compiler: GrammarCompiler, grammar: Any, seed: int) -> str | None:
    """A random walk's text, when it ended on end-of-sequence as a document the grammar
    accepts (what the server reports as "stop"); None otherwise."""
    for attempt in range(3):
        tokens = random_walk(compiler, grammar, seed + attempt)
        if tokens is not None and output_refusal(grammar, _finished(tokens)) is None:
            return compiler.tokenizer.decode(tokens[:-1])
    return None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    expression=EXPRESSIONS, kind=st.sampled_from(["gbnf", "regex"]), seed=st.integers(0, 2**32 - 1)
)
def test_a_stop_output_matches_every_accepted_grammar(
    compiler: GrammarCompiler, expression: dict[str, Any], kind: str, seed: int
) -> None:
    oracle = as_regex(expression)
    text = f"root ::= {as_gbnf(expression)}\n" if kind == "gbnf" else oracle
    try:
        grammar = compiler.compile_source(kind, text, kind)  # type: ignore[arg-type]
    except GrammarError as exc:
        # Refused at compile time, never half-enforced: a grammar of the empty string only,
        # or GBNF whose Lark conversion llguidance cannot read (a repetition of a
        # repetition, ``(("1")?)?``, comes out as ``"1"??``).
        assert ("admits no document" in str(exc) and re.fullmatch(oracle, "")) or kind == "gbnf"
        return
    output = _walk_text(compiler, grammar, seed)
    if output is not None:
        assert re.fullmatch(oracle, output), (text, output)


@settings(max_examples=40, deadline=None)
@given(
    choices=st.lists(st.text(_ALPHABET + '"\\é', min_size=1, max_size=6), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_choice_output_is_one_of_the_choices(
    compiler: GrammarCompiler, choices: list[str], seed: int
) -> None:
    grammar = compiler.compile_source("grammar", choice_grammar(choices), "guided_choice")
    output = _walk_text(compiler, grammar, seed)
    if output is not None:
        assert output in choices


@pytest.mark.parametrize(
    "kind,text,match",
    [
        ("gbnf", 'root ::= "a" missing', "missing"),
        ("gbnf", 'top ::= "a"', "root"),
        ("gbnf", 'root ::= "a', "end of input|Expected"),
        ("grammar", 'start: "a" )', "expecting"),
        ("regex", "(a", "regex|unclosed|parse"),
    ],
)
def test_a_grammar_that_does_not_parse_is_refused_naming_why(
    compiler: GrammarCompiler, kind: str, text: str, match: str
) -> None:
    with pytest.raises(GrammarError, match=match):
        compiler.compile_source(kind, text, kind)  # type: ignore[arg-type]
