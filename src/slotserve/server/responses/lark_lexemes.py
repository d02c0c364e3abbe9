"""The lexemes of a client's Lark grammar (`lark_json`): its definition read as Lark's
tokens (`lex`), and its string literals (`string_lark`) and regular expressions
(`parse_regex`, `regex_lark`) as Lark over their JSON-escaped images, in lexemes of which
none holds a backslash after its first byte (`lark_json`'s docstring says why). What the
rewrite cannot carry over faithfully is `UnsupportedLark`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set
from dataclasses import dataclass

# The characters JSON escapes, each to its one canonical escape.
SPECIALS = frozenset({'"', "\\", *map(chr, range(0x20))})
_PLAIN_CLASS = r'[^"\\\x00-\x1f]'  # a regular expression class of every other character
_TOKEN = re.compile(
    r"""(?P<skip>(?:\#|//)[^\n]*|[ \t]+)
    |(?P<newline>(?:\r?\n)+[ \t]*)
    |(?P<string>"(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2})|[^"\\\x00-\x1f\x7f])*"i?)
    |(?P<regexp>/(?:\\.|[^/\\])+/[imslux]*)
    |(?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)
    |(?P<number>[0-9]+)
    |(?P<op>\.\.|->|[:,(){}\[\]|+*?])
    |(?P<other>%[a-z]+|<[^<>\s]+>|@[a-zA-Z0-9_\-]+|::|.)""",
    re.VERBOSE | re.DOTALL,
)
UNSUPPORTED = {
    "%import": "imports (define the terminal yourself, e.g. WS: /[ \\t]+/)",
    "%ignore": "%ignore (write the ignored text into the rules where it may come)",
    "~": "`~` (write a repetition as {m,n})",
    "&": "`&` (write the terminal without an intersection)",
    ".": "priorities (`name.N`; leave the priority out)",
    "=": "lexeme options (`name[...]`; leave them out)",
}


class UnsupportedLark(ValueError):
    """A grammar this rewrite cannot carry over faithfully (the message says where, what
    and how to write it instead)."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    where: str  # "line L, column C"


def lex(definition: str) -> list[Token]:
    tokens, line, start = [], 1, 0
    for match in _TOKEN.finditer(definition):
        kind = match.lastgroup or "other"
        where = f"line {line}, column {match.start() - start + 1}"
        if kind != "skip":
            tokens.append(Token(kind, match.group(), where))
        if "\n" in match.group():
            line += match.group().count("\n")
            start = match.start() + match.group().rindex("\n") + 1
    return tokens


def refuse(token: Token, what: str) -> UnsupportedLark:
    return UnsupportedLark(f"{token.where}: not supported in a custom tool's grammar: {what}")


def literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's syntax; DEL escaped, as Lark wants)."""
    return json.dumps(text).replace("\x7f", "\\u007f")


def _image(char: str) -> str:
    """The JSON escape of one character JSON escapes, as a Lark literal."""
    return literal(json.dumps(char)[1:-1])


# -- regular expressions ---------------------------------------------------------------------


@dataclass
class _Node:
    """A piece of a regular expression: its source text, whether it may match a character
    JSON escapes, and how it is built (``kind``: ``char``, ``class``, ``group``, ``seq``,
    ``alt``, ``repeat``)."""

    kind: str
    source: str
    special: bool
    parts: list[_Node]
    escapes: tuple[str, ...] = ()  # char/class: the characters JSON escapes it matches
    plain: str = ""  # class: a class of the characters it matches that JSON leaves alone
    quantifier: str = ""  # repeat


_PERL_SPECIALS = {
    "d": "",
    "w": "",
    "s": "\t\n\x0b\x0c\r",
    "D": "".join(sorted(SPECIALS)),
    "W": "".join(sorted(SPECIALS)),
    "S": "".join(sorted(SPECIALS - set("\t\n\x0b\x0c\r"))),
}
_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\x0c", "v": "\x0b", "a": "\x07"}


class _Regex:
    """A recursive-descent reader of the supported regular expressions."""

    def __init__(self, text: str, token: Token) -> None:
        self.text, self.at, self.token = text, 0, token

    def fail(self, what: str) -> UnsupportedLark:
        return refuse(self.token, f"{what} (in the regular expression /{self.text}/)")

    def peek(self, ahead: int = 0) -> str:
        index = self.at + ahead
        return self.text[index] if index < len(self.text) else ""

    def alternation(self) -> _Node:
        start = self.at
        branches = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        special = any(b.special for b in branches)
        return _Node("alt", self.text[start : self.at], special, branches)

    def sequence(self) -> _Node:
        start, items = self.at, []
        while self.peek() not in ("", "|", ")"):
            items.append(self.repeated())
        return _Node("seq", self.text[start : self.at], any(i.special for i in items), items)

    def repeated(self) -> _Node:
        start = self.at
        node = self.atom()
        while True:
            found = re.compile(r"(?:[*+?]|\{[0-9]+(?:,[0-9]*)?\})\??").match(self.text, self.at)
            if not found:
                return node
            self.at = found.end()
            node = _Node(
                "repeat", self.text[start : self.at], node.special, [node], quantifier=found.group()
            )

    def atom(self) -> _Node:
        start, char = self.at, self.peek()
        if char == "(":
            opening = re.compile(r"\((?:\?:|\?P?<[A-Za-z_][A-Za-z0-9_]*>)?").match(self.text, start)
            assert opening is not None
            if self.text.startswith("(?", start) and opening.end() == start + 1:
                raise self.fail("a group with flags or a lookaround, `(?...)`,")
            self.at = opening.end()
            inner = self.alternation()
            if self.peek() != ")":
                raise self.fail("an unclosed group")
            self.at += 1
            return _Node("group", self.text[start : self.at], inner.special, [inner])
        if char == "[":
            return self.character_class()
        if char == ".":
            self.at += 1
            return self.chars(".", SPECIALS - {"\n"}, _PLAIN_CLASS)
        if char in ("^", "$"):
            raise self.fail("an anchor (`^`, `$`: the grammar matches the whole input anyway)")
        if char in ("*", "+", "?", "{", ")", "]", "}"):
            raise self.fail(f"a stray {char!r} (escape it)")
        if char == "\\":
            perl = self.peek(1)
            if perl in _PERL_SPECIALS:
                self.at += 2
                escapes = set(_PERL_SPECIALS[perl])
                return self.chars(f"\\{perl}", escapes, f"[[\\{perl}]&&{_PLAIN_CLASS}]")
        found = self.character()
        if found in SPECIALS:
            return _Node("char", self.text[start : self.at], True, [], escapes=(found,))
        return _Node("char", self.text[start : self.at], False, [])

    def chars(self, source: str, escapes: Set[str], plain: str) -> _Node:
        found = tuple(sorted(escapes))
        return _Node("class", source, bool(found), [], escapes=found, plain=plain)

    def character(self) -> str:
        """One character, written plainly or as an escape."""
        char = self.peek()
        if not char:
            raise self.fail("a trailing backslash")
        self.at += 1
        if char != "\\":
            return char
        code = self.peek()
        self.at += 1
        if code in _ESCAPED:
            return _ESCAPED[code]
        hexed = re.compile(r"x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[xuU]\{[0-9a-fA-F]+\}")
        found = hexed.match(self.text, self.at - 1)
        if found:
            self.at = found.end()
            digits = found.group()[1:].strip("{}")
            if int(digits, 16) > 0x10FFFF:
                raise self.fail(f"the escape \\{found.group()} (beyond Unicode)")
            return chr(int(digits, 16))
        if code and not code.isalnum() and code.isascii() and code not in "<>":
            return code
        what = {"b": "a word boundary", "B": "a word boundary", "A": "an anchor", "z": "an anchor"}
        if code.isdigit():
            raise self.fail(f"the escape \\{code} (a backreference or an octal escape)")
        if code in "pP":
            raise self.fail(f"the Unicode class \\{code}{{...}} (write the characters as a class)")
        raise self.fail(what.get(code, f"the escape \\{code}"))

    def character_class(self) -> _Node:
        start = self.at
        self.at += 1
        negated = self.peek() == "^"
        self.at += negated
        members: set[str] = set()  # the characters JSON escapes that the items hold
        first = True
        while self.peek() != "]" or first:
            if not self.peek():
                raise self.fail("an unclosed character class")
            if self.peek() == "[" or self.text.startswith(("&&", "--", "~~"), self.at):
                raise self.fail("a nested class or a class operation (`[[...]]`, `&&`, `--`)")
            first = False
            if self.peek() == "\\" and self.peek(1) in _PERL_SPECIALS:
                members |= set(_PERL_SPECIALS[self.peek(1)])
                self.at += 2
                continue
            low = self.character()
            high = low
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.at += 1
                high = self.character()
                if high < low:
                    raise self.fail(f"the range {low!r}-{high!r} (it runs backwards)")
            members |= {c for c in SPECIALS if low <= c <= high}
        self.at += 1
        source = self.text[start : self.at]
        escapes = (SPECIALS - members) if negated else members
        return self.chars(source, escapes, f"[{source}&&{_PLAIN_CLASS}]")


def parse_regex(source: str, token: Token) -> _Node:
    reader = _Regex(source, token)
    node = reader.alternation()
    if reader.at != len(source):
        raise reader.fail("an unopened `)`")
    return node


def regex_lark(node: _Node) -> str:
    """``node``'s escaped image as Lark: the regular expression itself when it matches no
    character JSON escapes, else a rule expression over lexemes of one character or one
    escape each (`_rules`)."""
    return f"/{node.source}/" if not node.special else _rules(node, True)


def _rules(node: _Node, free: bool) -> str:
    """``node`` as a rule expression whose lexemes hold one character or one escape, but
    for a repeated class that ``free`` lets run as one lexeme: nothing that begins with a
    plain character follows it inside the regular expression, so the run ends where the
    original terminal's lexeme would."""
    if node.kind == "char":
        return _image(node.escapes[0]) if node.special else f"/{node.source}/"
    if node.kind == "class":
        plain = node.plain if node.special else node.source
        return "(" + " | ".join([f"/{plain}/", *map(_image, node.escapes)]) + ")"
    if node.kind == "group":
        return _rules(node.parts[0], free)
    if node.kind == "alt":
        return "(" + " | ".join(_rules(part, free) for part in node.parts) + ")"
    if node.kind == "repeat":
        (inner,) = node.parts
        quantifier = node.quantifier  # laziness (a trailing `?`) does not change a language
        quantifier = (
            quantifier[:-1] if len(quantifier) > 1 and quantifier[-1] == "?" else quantifier
        )
        if free and inner.kind == "class" and quantifier in ("*", "+"):
            plain = inner.plain if inner.special else inner.source
            pieces = [f"/{plain}+/", *map(_image, inner.escapes)]
            return "(" + " | ".join(pieces) + ")" + quantifier
        return f"({_rules(inner, False)}){quantifier}"
    pieces = []
    for index, part in enumerate(node.parts):
        after = node.parts[index + 1] if index + 1 < len(node.parts) else None
        followed = free if after is None else (after.kind == "char" and after.special)
        pieces.append(_rules(part, followed))
    return "(" + " ".join(pieces) + ")" if pieces else '""'


def string_lark(text: str) -> str:
    """A literal's escaped image: the literal itself, or its plain runs and its escapes."""
    runs = re.findall(r'[^"\\\x00-\x1f]+|["\\\x00-\x1f]', text)
    if not any(c in SPECIALS for c in text):
        return literal(text)
    pieces = [_image(run) if run in SPECIALS else literal(run) for run in runs]
    return "(" + " ".join(pieces) + ")"


def string_value(token: Token) -> str:
    if token.text.endswith("i"):
        raise refuse(token, 'a case-insensitive literal ("..."i; write the cases out)')
    body = re.sub(r"\\x([0-9a-fA-F]{2})", r"\\u00\1", token.text)
    value: str = json.loads(body)
    return value
