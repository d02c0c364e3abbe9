"""A client's Lark grammar rewritten over the JSON-escaped text of its language, so that a
call's ``{"input": "..."}`` holds, between its quotes, a string of that language as JSON
writes it (`escaped_rules`).

JSON escapes ``"``, ``\\`` and the control characters (U+0000-U+001F), each as a sequence
that begins with a backslash (the canonical one ``json.dumps`` writes: ``\\"``, ``\\n``,
``\\u001f``); every other character stands for itself. So every string literal and every
regular expression of the grammar is replaced by one of the escaped images of what it
matches; its rules stay as they are.

llguidance lexes greedily with one byte of lookahead: a lexeme that could go on with one
escape (``/.*/`` can take ``\\t``) would swallow the backslash that begins another
(``"\\n"`` after it) and then fail. So no lexeme here holds a backslash after its first
byte. A literal that holds a character JSON escapes is its plain runs and its escapes, one
lexeme each; a regular expression that matches one becomes a rule over lexemes of one
character or one escape (a repeated class runs as one lexeme where nothing plain can follow
it inside the expression: ``/.*/`` is ``(/[^"\\\\\\x00-\\x1f]+/ | "\\\\t" | ...)*``); a
terminal that needs such a rule becomes one too. So the escaped grammar never matches the
escape of a string outside the grammar's language (read as its rules say). It matches
where llguidance matches the string under the grammar itself, with two known departures:
a terminal split so can lose to a longer lexeme allowed at the same point in llguidance's
greedy lexer (``/a*"/ | /aa/`` refuses ``aa"``), and where that greedy lexing of one
terminal spanning an escaped character refuses what the rules allow, the escaped grammar
may accept it. An exact rewrite would split each terminal at its escapes by the states of
its automaton; this one splits by its syntax.

Supported: rules and terminals (``?``/``!``/``_`` names, aliases ``-> name``), string
literals (not ``"..."i``), literal ranges ``"a".."z"``, regular expressions without flags
made of literal characters, escapes, character classes (ranges, negation, ``\\d \\w \\s``
and their negations), ``.``, groups, alternation and quantifiers; ``|``, ``*``, ``+``,
``?``, ``[...]``, ``{m,n}`` in rules. Anything else is `UnsupportedLark`, naming what and
the way around it.
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
_UNSUPPORTED = {
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
class _Token:
    kind: str
    text: str
    where: str  # "line L, column C"


def _tokens(definition: str) -> list[_Token]:
    tokens, line, start = [], 1, 0
    for match in _TOKEN.finditer(definition):
        kind = match.lastgroup or "other"
        where = f"line {line}, column {match.start() - start + 1}"
        if kind != "skip":
            tokens.append(_Token(kind, match.group(), where))
        if "\n" in match.group():
            line += match.group().count("\n")
            start = match.start() + match.group().rindex("\n") + 1
    return tokens


def _refuse(token: _Token, what: str) -> UnsupportedLark:
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

    def __init__(self, text: str, token: _Token) -> None:
        self.text, self.at, self.token = text, 0, token

    def fail(self, what: str) -> UnsupportedLark:
        return _refuse(self.token, f"{what} (in the regular expression /{self.text}/)")

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


def _regex(source: str, token: _Token) -> _Node:
    reader = _Regex(source, token)
    node = reader.alternation()
    if reader.at != len(source):
        raise reader.fail("an unopened `)`")
    return node


def _lark(node: _Node) -> str:
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


def _string(text: str) -> str:
    """A literal's escaped image: the literal itself, or its plain runs and its escapes."""
    runs = re.findall(r'[^"\\\x00-\x1f]+|["\\\x00-\x1f]', text)
    if not any(c in SPECIALS for c in text):
        return literal(text)
    pieces = [_image(run) if run in SPECIALS else literal(run) for run in runs]
    return "(" + " ".join(pieces) + ")"


def _string_value(token: _Token) -> str:
    if token.text.endswith("i"):
        raise _refuse(token, 'a case-insensitive literal ("..."i; write the cases out)')
    body = re.sub(r"\\x([0-9a-fA-F]{2})", r"\\u00\1", token.text)
    value: str = json.loads(body)
    return value


# -- grammars --------------------------------------------------------------------------------


@dataclass
class _Definition:
    name: str  # as written, with its markers (`?`, `!`)
    body: list[_Token]
    terminal: bool


def _statements(tokens: list[_Token]) -> list[_Definition]:
    """The definitions, each a name, ``:`` and the tokens to its end (a line break that no
    ``|`` continues)."""
    found: list[_Definition] = []
    index = 0
    while index < len(tokens):
        head = tokens[index]
        if head.kind == "newline":
            index += 1
            continue
        after = tokens[index + 1] if index + 1 < len(tokens) else head
        if head.kind != "name" or after.text != ":":
            culprit = after if head.kind == "name" else head
            heads = {"[": _UNSUPPORTED["="], "{": "templates (`name{...}`; write each use out)"}
            what = heads.get(culprit.text) if culprit is after else None
            what = what or _what(culprit) or f"{culprit.text!r} here (expected `name:`)"
            raise _refuse(culprit, what)
        end = index + 2
        while end < len(tokens) and not (
            tokens[end].kind == "newline"
            and not (end + 1 < len(tokens) and tokens[end + 1].text == "|")
        ):
            end += 1
        bare = head.text.lstrip("!?")
        found.append(_Definition(head.text, tokens[index + 2 : end], bare.lstrip("_")[0].isupper()))
        index = end
    return found


def _what(token: _Token) -> str | None:
    """What an unsupported token is, and the way around it; None when it is supported."""
    text = token.text
    if text in _UNSUPPORTED:
        return _UNSUPPORTED[text]
    if text.startswith("%"):
        return f"the directive {text}"
    if text.startswith("<"):
        return f"a special token {text}"
    if text.startswith("@"):
        return f"a reference to another grammar {text}"
    if token.kind == "other":
        return f"{text!r}"
    return None


def escaped_rules(definition: str, prefix: str) -> str:
    """Lark rules matching the JSON-escaped images of ``definition``'s language (see the
    module's docstring); every name begins with ``prefix`` (``prefix`` + ``start`` is its
    start), rules in lower case and terminals in upper case, so the rules can join another
    grammar whose names do not begin so. Raises `UnsupportedLark`."""
    definitions = _statements(_tokens(definition))
    bare = {d.name.lstrip("!?"): d for d in definitions}
    if "start" not in bare:
        raise UnsupportedLark("the grammar has no `start` rule (write `start: ...`)")
    atoms: dict[int, str] = {}  # a body token's Lark, where it is a string or an expression
    special: set[str] = set()  # the terminals that become rules
    for d in definitions:
        body = d.body
        for at, token in enumerate(body):
            what = _what(token)
            counted = at + 1 < len(body) and (
                body[at + 1].kind == "number" or body[at + 1].text == ","
            )
            if token.text == "{" and not counted:
                what = "templates (`name{...}`; write each use out)"
            if what is not None:
                raise _refuse(token, what)
            if token.kind == "regexp":
                pattern, flags = token.text[1:].rsplit("/", 1)
                if flags:
                    raise _refuse(token, f"the regular expression flags {flags!r}")
                node = _regex(pattern, token)
                atoms[id(token)] = _lark(node)
                special |= {d.name} if node.special else set()
            elif token.kind == "string":
                ranged = at + 2 < len(body) and body[at + 1].text == ".."
                if ranged or (at >= 2 and body[at - 1].text == ".."):
                    if ranged:
                        low, high = _string_value(token), _string_value(body[at + 2])
                        if len(low) != 1 or len(high) != 1:
                            raise _refuse(token, "a range of literals longer than a character")
                        cls = f"[\\u{{{ord(low):x}}}-\\u{{{ord(high):x}}}]"
                        node = _regex(cls, token)
                        atoms[id(token)] = _lark(node)
                        special |= {d.name} if node.special else set()
                    continue
                value = _string_value(token)
                atoms[id(token)] = _string(value)
                special |= {d.name} if any(c in SPECIALS for c in value) else set()
    grown = True
    while grown:  # a terminal that uses a terminal that became a rule becomes one too
        grown = False
        for d in definitions:
            uses = {t.text for t in d.body if t.kind == "name"}
            if d.terminal and d.name not in special and uses & special:
                special.add(d.name)
                grown = True

    def renamed(name: str) -> str:
        markers = name[: len(name) - len(name.lstrip("!?"))]
        name = name[len(markers) :]
        if name not in bare or not bare[name].terminal:
            return f"{markers}{prefix.lower()}{name}"  # a rule (or an alias)
        if name in special:
            return f"{prefix.lower()}-{name.lower()}"
        return f"{prefix.upper()}{name}"

    lines = []
    for d in definitions:
        pieces: list[str] = []
        skip = 0
        for at, token in enumerate(d.body):
            if skip:
                skip -= 1
            elif token.kind == "name":
                pieces.append(renamed(token.text))
            elif token.kind == "newline":
                pieces.append("\n   ")
            elif id(token) in atoms:
                pieces.append(atoms[id(token)])
                skip = 2 if at + 1 < len(d.body) and d.body[at + 1].text == ".." else 0
            else:
                pieces.append(token.text)
        lines.append(f"{renamed(d.name)}: {' '.join(pieces)}")
    return "\n".join(lines) + "\n"
