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

from dataclasses import dataclass

from slotserve.server.responses.lark_lexemes import (
    SPECIALS,
    UNSUPPORTED,
    Token,
    UnsupportedLark,
    lex,
    literal,
    parse_regex,
    refuse,
    regex_lark,
    string_lark,
    string_value,
)

__all__ = ["UnsupportedLark", "escaped_rules", "literal"]


# -- grammars --------------------------------------------------------------------------------


@dataclass
class _Definition:
    name: str  # as written, with its markers (`?`, `!`)
    body: list[Token]
    terminal: bool


def _statements(tokens: list[Token]) -> list[_Definition]:
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
            heads = {"[": UNSUPPORTED["="], "{": "templates (`name{...}`; write each use out)"}
            what = heads.get(culprit.text) if culprit is after else None
            what = what or _what(culprit) or f"{culprit.text!r} here (expected `name:`)"
            raise refuse(culprit, what)
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


def _what(token: Token) -> str | None:
    """What an unsupported token is, and the way around it; None when it is supported."""
    text = token.text
    if text in UNSUPPORTED:
        return UNSUPPORTED[text]
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
    definitions = _statements(lex(definition))
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
                raise refuse(token, what)
            if token.kind == "regexp":
                pattern, flags = token.text[1:].rsplit("/", 1)
                if flags:
                    raise refuse(token, f"the regular expression flags {flags!r}")
                node = parse_regex(pattern, token)
                atoms[id(token)] = regex_lark(node)
                special |= {d.name} if node.special else set()
            elif token.kind == "string":
                ranged = at + 2 < len(body) and body[at + 1].text == ".."
                if ranged or (at >= 2 and body[at - 1].text == ".."):
                    if ranged:
                        low, high = string_value(token), string_value(body[at + 2])
                        if len(low) != 1 or len(high) != 1:
                            raise refuse(token, "a range of literals longer than a character")
                        cls = f"[\\u{{{ord(low):x}}}-\\u{{{ord(high):x}}}]"
                        node = parse_regex(cls, token)
                        atoms[id(token)] = regex_lark(node)
                        special |= {d.name} if node.special else set()
                    continue
                value = string_value(token)
                atoms[id(token)] = string_lark(value)
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
