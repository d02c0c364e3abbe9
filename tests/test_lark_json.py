"""`responses.lark_json`: a Lark grammar rewritten over the JSON-escaped text of its
language, checked with llguidance's own matcher over a byte-level tokenizer.

Over generated small grammars (literals with quotes, backslashes and control characters,
character classes, ``.``, alternation, repetition, recursion such as balanced parentheses)
and strings drawn from them or at random, with ``e`` JSON's escaping:

the escaped grammar matches ``e(s)`` only when ``s`` is in the grammar's language (read as
a context-free grammar, by a reference parser here), and llguidance's reading of the
grammar itself agrees with that parser. The other way (``e(s)`` matched wherever llguidance
matches ``s``) holds on the hand-made grammars below, but not always: a terminal split into
one-character lexemes can lose to a longer lexeme in llguidance's greedy lexer
(`test_a_split_terminal_can_lose_to_a_longer_lexeme`); and where llguidance's greedy
lexing of one terminal spanning an escaped character refuses what the rules allow, the
escaped grammar may accept it (`test_a_greedy_terminal_over_escapes_still_ends`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from slotserve.server.responses.lark_json import UnsupportedLark, escaped_rules, literal
from slotserve.testing import tiny_tokenizer

PREFIX = "c0_"


@functools.cache
def _tokenizer() -> Any:
    return llguidance.LLTokenizer(tiny_tokenizer().to_str(), eos_token=2)


def matches(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for ``grammar`` takes ``text`` whole."""
    tokenizer = _tokenizer()
    lark = llguidance.LLMatcher.grammar_from_lark(grammar)
    matcher = llguidance.LLMatcher(tokenizer, lark, log_level=0)
    assert not matcher.is_error(), (matcher.get_error(), grammar)
    taken = matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode()))
    return bool(taken) and matcher.is_accepting()


def escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def rewritten(grammar: str) -> str:
    return escaped_rules(grammar, PREFIX) + f"start: {PREFIX}start\n"


# -- generated grammars, with a reference parser ------------------------------------------

ALPHABET = 'ab"\\\n\t(é'
CLASSES = ["[ab]", "[^a]", '[a"]', "[\\n\\\\b]", "[\\t-\\n]", ".", "\\s", "\\S", '[^"\\\\]']


@dataclass(frozen=True)
class Expr:
    """A rule's body: ``kind`` is ``lit`` (``value``), ``re`` (``value``, a regular
    expression that Python's ``re`` and llguidance read alike), ``ref`` (rule ``value``),
    ``term`` (terminal ``value``), ``seq``/``alt`` (``parts``) or ``star``/``plus``/``opt``
    (``parts[0]``)."""

    kind: str
    value: str = ""
    parts: tuple[Expr, ...] = ()


def _lark(e: Expr) -> str:
    if e.kind == "lit":
        return literal(e.value)
    if e.kind == "re":
        return "/" + e.value.replace("/", "\\/") + "/"
    if e.kind in ("ref", "term"):
        return e.value
    if e.kind == "seq":
        return " ".join(map(_lark, e.parts)) if e.parts else '""'
    if e.kind == "alt":
        return "(" + " | ".join(map(_lark, e.parts)) + ")"
    return "(" + _lark(e.parts[0]) + ")" + {"star": "*", "plus": "+", "opt": "?"}[e.kind]


@dataclass(frozen=True)
class Grammar:
    rules: tuple[Expr, ...]  # rule i is r{i}; r0 is start
    terminals: tuple[str, ...]  # terminal i is T{i}: a regular expression

    def lark(self) -> str:
        names = ["start", *(f"r{i}" for i in range(1, len(self.rules)))]
        lines = [f"{n}: {_lark(r)}" for n, r in zip(names, self.rules, strict=True)]
        lines += [f"T{i}: /{t}/" for i, t in enumerate(self.terminals)]
        return "\n".join(lines) + "\n"

    def ends(self, e: Expr, text: str, at: int) -> frozenset[int]:
        """Where a match of ``e`` from ``at`` can end (recursion always consumes an
        opening parenthesis first, so this terminates)."""
        return _ends(self, e, text, at)


@functools.lru_cache(maxsize=100_000)
def _ends(g: Grammar, e: Expr, text: str, at: int) -> frozenset[int]:
    if e.kind == "lit":
        return frozenset([at + len(e.value)] if text.startswith(e.value, at) else [])
    if e.kind in ("re", "term"):
        pattern = re.compile(e.value if e.kind == "re" else g.terminals[int(e.value[1:])])
        return frozenset(j for j in range(at, len(text) + 1) if pattern.fullmatch(text, at, j))
    if e.kind == "ref":
        return _ends(g, g.rules[0 if e.value == "start" else int(e.value[1:])], text, at)
    if e.kind == "alt":
        return frozenset().union(*(_ends(g, p, text, at) for p in e.parts))
    if e.kind == "seq":
        here = frozenset([at])
        for part in e.parts:
            here = frozenset().union(*(_ends(g, part, text, i) for i in here))
        return here
    inner = e.parts[0]
    if e.kind == "opt":
        return _ends(g, inner, text, at) | {at}
    found: set[int] = set()
    frontier = {at}
    while frontier:  # star and plus: one more repetition while new ends appear
        step = set().union(*(_ends(g, inner, text, i) for i in frontier))
        frontier = step - found
        found |= step
    return frozenset(found | ({at} if e.kind == "star" else set()))


def in_language(g: Grammar, text: str) -> bool:
    return len(text) in g.ends(g.rules[0], text, 0)


def _regexes() -> st.SearchStrategy[str]:
    char = st.sampled_from(["a", "b", '"', "\\\\", "\\n", "\\t", "é"])
    atom = st.one_of(char, st.sampled_from(CLASSES))
    quantified = st.tuples(atom, st.sampled_from(["", "*", "+", "?", "{1,2}"])).map("".join)
    piece = st.lists(quantified, min_size=1, max_size=3).map("".join)
    return st.lists(piece, min_size=1, max_size=2).map("|".join)


def _ref(index: int) -> Expr:
    return Expr("ref", f"r{index}" if index else "start")


@st.composite
def grammars(draw: Callable[..., Any]) -> Grammar:
    count = draw(st.integers(1, 3))
    terminals = tuple(draw(st.lists(_regexes(), max_size=2)))

    def expr(index: int, depth: int) -> st.SearchStrategy[Expr]:
        leaves: list[st.SearchStrategy[Expr]] = [
            st.text(ALPHABET, max_size=3).map(lambda v: Expr("lit", v)),
            _regexes().map(lambda v: Expr("re", v)),
            # recursion behind an opening parenthesis, as balanced parentheses nest
            st.integers(0, count - 1).map(
                lambda i: Expr("seq", parts=(Expr("lit", "("), _ref(i), Expr("lit", ")")))
            ),
        ]
        if index + 1 < count:
            leaves.append(st.integers(index + 1, count - 1).map(lambda i: Expr("ref", f"r{i}")))
        if terminals:
            leaves.append(st.integers(0, len(terminals) - 1).map(lambda i: Expr("term", f"T{i}")))
        leaf = st.one_of(leaves)
        if depth == 0:
            return leaf
        inner = expr(index, depth - 1)
        return st.one_of(
            leaf,
            st.lists(inner, max_size=3).map(lambda p: Expr("seq", parts=tuple(p))),
            st.lists(inner, min_size=2, max_size=3).map(lambda p: Expr("alt", parts=tuple(p))),
            st.tuples(st.sampled_from(["star", "plus", "opt"]), inner).map(
                lambda k: Expr(k[0], parts=(k[1],))
            ),
        )

    rules = tuple(draw(expr(i, 2)) for i in range(count))
    return Grammar(rules, terminals)


def _sample(g: Grammar, e: Expr, draw: Callable[..., Any], depth: int = 0) -> str:
    """A string of ``e``'s language (short, and not always one)."""
    if e.kind == "lit":
        return e.value
    if e.kind in ("re", "term"):
        pattern = e.value if e.kind == "re" else g.terminals[int(e.value[1:])]
        found: str = draw(st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) < 6))
        return found
    if e.kind == "ref":
        if depth > 3:
            return ""
        rule = g.rules[0 if e.value == "start" else int(e.value[1:])]
        return _sample(g, rule, draw, depth + 1)
    if e.kind == "seq":
        return "".join(_sample(g, p, draw, depth) for p in e.parts)
    if e.kind == "alt":
        return _sample(g, draw(st.sampled_from(e.parts)), draw, depth)
    low = 1 if e.kind == "plus" else 0
    times = draw(st.integers(low, 1 if e.kind == "opt" else 2))
    return "".join(_sample(g, e.parts[0], draw, depth) for _ in range(times))


@settings(max_examples=150, deadline=None)
@given(grammars(), st.data())
def test_the_escaped_grammar_matches_the_escaped_language(g: Grammar, data: st.DataObject) -> None:
    grammar = g.lark()
    escaped_grammar = rewritten(grammar)
    texts = [data.draw(st.text(ALPHABET, max_size=6)), _sample(g, g.rules[0], data.draw)]
    for text in texts:
        cfg, client = in_language(g, text), matches(grammar, text)
        ours = matches(escaped_grammar, escaped(text))
        assert not ours or cfg, (grammar, escaped_grammar, text)  # never outside the language
        assert not client or cfg  # the reference parser agrees with llguidance's reading


# -- hand-made cases ---------------------------------------------------------------------------

CASES = [
    # a line of anything, then a line break: the line can go on with `\t`, `\"`, `\\`
    ('start: LINE "\\n"\nLINE: /.*/', ['a"b\n', "a\\b\t\n", "\n"], ["ab", "a\nb\n"]),
    # a quoted argument: the quote closes although the text may go on with `\n` or `\\`
    (
        'start: "echo \\"" TEXT "\\""\nTEXT: /[^"]*/',
        ['echo "a b"', 'echo "x\n\\y"'],
        ['echo "a"b"'],
    ),
    # balanced parentheses, with a recursive rule
    ('start: p\np: ("(" p ")")*', ["", "(()())", "()(())"], ["(()", ")("]),
    # a literal range, a class with escapes, a terminal built of terminals
    (
        'start: W+\nW: "a".."c" | TAB DIGITS\nTAB: /[\\t ]/\nDIGITS: /\\d{1,2}/',
        ["ab\t1 22"],
        ["d", "\t"],
    ),
    ('start: "\\u0001" /[\\x00-\\x02]+/ "\\\\" /\\x7f/', ["\x01\x00\x02\\\x7f"], ["\x01\\\x7f"]),
]


@pytest.mark.parametrize(("grammar", "inside", "outside"), CASES)
def test_hand_made_grammars(grammar: str, inside: list[str], outside: list[str]) -> None:
    for text in inside:
        assert matches(grammar, text) and matches(rewritten(grammar), escaped(text)), text
    for text in outside:
        assert not matches(rewritten(grammar), escaped(text)), text


def test_a_greedy_terminal_over_escapes_still_ends() -> None:
    """llguidance lexes ``/[^"]*/`` greedily over the line break the rule then wants; the
    escaped grammar reads the terminal as its rules do."""
    grammar = 'start: TEXT "\\n"\nTEXT: /[^"]*/'
    assert not matches(grammar, "ab\n")
    assert matches(rewritten(grammar), escaped("ab\n"))


def test_a_split_terminal_can_lose_to_a_longer_lexeme() -> None:
    """The known gap: ``/a*"/`` becomes one-character lexemes, and llguidance lexes ``aa``
    greedily as the other alternative's ``/aa/``, which the quote cannot follow."""
    grammar = 'start: /a*"/ | /aa/'
    assert matches(grammar, 'aa"')
    assert not matches(rewritten(grammar), escaped('aa"'))


def test_a_grammar_without_escapes_is_the_same_grammar_renamed() -> None:
    grammar = 'start: x+\nx: NUM | "a" -> y\nNUM: /[0-9]+/'
    assert rewritten(grammar) == (
        'c0_start: c0_x +\nc0_x: C0_NUM | "a" -> c0_y\nC0_NUM: /[0-9]+/\nstart: c0_start\n'
    )


@pytest.mark.parametrize(
    ("grammar", "named"),
    [
        ('%import common.WS\nstart: "a"', "imports"),
        ('start: "a"\n%ignore " "', "%ignore"),
        ('start: x{"a"}\nx{p}: p', "templates"),
        ('start[lazy]: "a"', "lexeme options"),
        ('start.2: "a"', "priorities"),
        ('start: "a"~2', "`~`"),
        ("start: /a/ & /b/", "`&`"),
        ("start: <|end|>", "special token"),
        ("start: @other", "another grammar"),
        ('start: "a"i', "case-insensitive"),
        ("start: /a/s", "flags"),
        ("start: /(?=a)a/", "lookaround"),
        ("start: /^a$/", "anchor"),
        ("start: /(a)\\1/", "backreference"),
        ("start: /\\p{L}/", "Unicode class"),
        ("start: /[[a]b]/", "nested class"),
        ("x: /a/", "no `start` rule"),
    ],
)
def test_what_cannot_be_carried_over_is_refused_by_name(grammar: str, named: str) -> None:
    with pytest.raises(UnsupportedLark, match=re.escape(named)):
        escaped_rules(grammar, PREFIX)


@example("a")
@given(st.text(max_size=20))
def test_literal_writes_the_text_lark_reads(text: str) -> None:
    assert matches(f"start: {literal(text)}\n", text)
