"""Tool-call syntaxes: how a model family writes its calls, as a grammar and read back.

A `CallSyntax` is one family's call text: ``prefix`` (which begins with the ``trigger``),
then calls written ``{"name": "NAME", "KEY": ARGUMENTS}`` with ``separator`` between them,
then ``suffix``. Hermes-style templates (Qwen 2.5/3, Hermes 2 Pro) write each call in
``<tool_call>`` tags, Mistral after ``[TOOL_CALLS]`` as a JSON list, Llama 3.x as a bare
object with ``parameters``; `GENERIC` is the format for templates that know no tools (as
llama.cpp's "generic"): the whole reply is ``{"tool_calls": [...]}`` or
``{"content": "..."}``. `template_syntax` picks one from a chat template's text.

`call_grammar` writes the llguidance (Lark) grammar a reply is decoded under: every call's
arguments under its function's JSON Schema (``%json``), with the server's fixed JSON
separators, or under the Lark rules given for them (`LarkArguments`); calls from the
first token, or (``lazy``) free text until the trigger appears.
`scan` reads calls back from a reply's text, whole or a prefix of it while it streams.

Pure functions of text: no tokenizer, no engine. Special tokens are named by the caller
(``specials``: text → id), so the grammar names them as tokens and the text they stand for
can be put back into a reply's text (the engine's text leaves special tokens out).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

SyntaxName = Literal["hermes", "mistral", "llama3", "generic"]
CALL_HEAD = '{"name": "'
CONTENT_HEAD = '{"content": '  # GENERIC's reply without calls: {"content": "..."}
# The JSON options of every call's arguments: the separators the server's structured
# outputs use, and no free whitespace (a small model offered it may never stop).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallSyntax:
    """One way to write tool calls (see the module's docstring). ``max_calls``: the most
    calls one reply holds in this syntax (None: any number)."""

    name: SyntaxName
    trigger: str
    prefix: str
    separator: str
    suffix: str
    arguments_key: str = "arguments"
    max_calls: int | None = None

    def call_text(self, name: str, arguments: str) -> str:
        return f'{CALL_HEAD}{name}", "{self.arguments_key}": {arguments}}}'

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        """The text of ``calls`` ((name, arguments JSON) pairs) in this syntax."""
        body = self.separator.join(self.call_text(name, args) for name, args in calls)
        return self.prefix + body + self.suffix


HERMES = CallSyntax(
    "hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"
)
MISTRAL = CallSyntax("mistral", "[TOOL_CALLS]", "[TOOL_CALLS][", ", ", "]")
# Llama 3.x writes one bare call; its templates refuse more than one in a message.
LLAMA3 = CallSyntax("llama3", CALL_HEAD, "", "", "", "parameters", max_calls=1)
GENERIC = CallSyntax("generic", '{"tool_calls": [', '{"tool_calls": [', ", ", "]}")
SYNTAXES = {syntax.name: syntax for syntax in (HERMES, MISTRAL, LLAMA3, GENERIC)}


def template_syntax(template: str, takes_tools: bool) -> CallSyntax | None:
    """The call syntax a chat template renders and its model writes, when the template
    takes the ``tools`` variable (``takes_tools``) and its call syntax is one known here;
    None: render the tools the generic way instead."""
    if not takes_tools:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3
    return None


# -- the grammar -------------------------------------------------------------------------

Mode = Literal["auto", "required"]


@dataclass(frozen=True)
class LarkArguments:
    """A call's arguments given as Lark rules rather than a JSON Schema: ``rules`` (whose
    names begin apart from `call_grammar`'s own: none begins with a letter and a digit),
    the one among them the arguments' whole text is (``entry``), and ``source``, the
    client's grammar they were written from (compiled alone first, so that its errors
    name the client's own text)."""

    rules: str
    entry: str
    source: str


def call_grammar(
    syntax: CallSyntax,
    functions: Sequence[tuple[str, Mapping[str, Any] | LarkArguments]],
    *,
    mode: Mode,
    parallel: bool,
    specials: Mapping[str, int] | None = None,
    free_tokens: Sequence[int] = (),
) -> str:
    """The Lark grammar of a reply that calls ``functions`` ((name, arguments schema or
    `LarkArguments`) pairs) in ``syntax``. ``required``: calls from the first token, at
    least one; ``auto``: free text, or (GENERIC) a JSON content reply, or the calls.
    ``parallel``: more than one call (up to the syntax's ``max_calls``). ``specials``:
    special tokens' text → id, so a literal that is a special token's text is written as
    that token. ``free_tokens``: tokens the free text of ``auto`` may hold too (a thinking
    model's ``<think>`` tags), when the trigger is a token (text cannot hold one, so the
    free text ends where it comes)."""
    specials = specials or {}
    lines = ["%llguidance {}"]
    for index, (name, schema) in enumerate(functions):
        middle = f'{name}", "{syntax.arguments_key}": '
        if isinstance(schema, LarkArguments):
            lines += [f"args_{index}: {schema.entry}", schema.rules.rstrip("\n")]
        else:
            arguments = {**schema, "x-guidance": JSON_OPTIONS}
            lines.append(f"args_{index}: %json {json.dumps(arguments)}")
        lines.append(f'body_{index}: {_literal(middle, specials)} args_{index} "}}"')
    lines.append("body: " + " | ".join(f"body_{i}" for i in range(len(functions))))
    many = parallel and syntax.max_calls != 1
    repeat = f" ({_literal(syntax.separator + CALL_HEAD, specials)} body)*" if many else ""
    lines.append(f"rest: body{repeat} {_literal(syntax.suffix, specials)}".rstrip())
    opening = syntax.prefix + CALL_HEAD
    calls = f"{_literal(opening, specials)} rest"
    if mode == "required":
        lines.append(f"start: {calls}")
    elif syntax is GENERIC:
        lines.append(f'start: {calls} | {_literal(CONTENT_HEAD, specials)} content "}}"')
        lines.append('content: %json {"type": "string"}')
    else:
        after = _literal(opening[len(syntax.trigger) :], specials)
        trigger_id = specials.get(syntax.trigger)
        if trigger_id is not None and free_tokens:
            pieces = " | ".join(["TEXT", *(f"<[{token}]>" for token in free_tokens)])
            lines.append(f"free: ({pieces})*")
            lines.append(f"start: free | free <[{trigger_id}]> {after} rest")
            lines.append(r"TEXT: /(.|\n)+/")
            return "\n".join(lines) + "\n"
        if trigger_id is not None:  # text cannot hold a special token: no need to be lazy
            lines.append(f"trigger: TEXT <[{trigger_id}]>")
        else:
            lines.append(f"trigger[lazy]: TEXT {json.dumps(syntax.trigger)}")
        lines.append(f"start: TEXT | trigger {after} rest")
        lines.append(r"TEXT: /(.|\n)*/")
    return "\n".join(lines) + "\n"


def _literal(text: str, specials: Mapping[str, int]) -> str:
    """``text`` as Lark: quoted strings, with any special token's text as that token."""
    if not text:
        return ""
    names = sorted(specials, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, names))) if names else None
    parts: list[str] = []
    start = 0
    for match in pattern.finditer(text) if pattern else ():
        if match.start() > start:
            parts.append(json.dumps(text[start : match.start()]))
        parts.append(f"<[{specials[match.group()]}]>")
        start = match.end()
    if start < len(text):
        parts.append(json.dumps(text[start:]))
    return " ".join(parts)


# -- reading calls back --------------------------------------------------------------------


@dataclass
class PartialCall:
    """A call as far as the text goes: ``name`` once it is whole, ``arguments`` the JSON
    text written so far (whole once ``complete``)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Scan:
    """What a reply's text holds: the ``content`` that is plain text, the calls begun,
    whether the calls' text ended (``closed``), and whether the text after the trigger
    broke the syntax (``broken``: only possible when the grammar did not write it)."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)
    closed: bool = False
    broken: bool = False


# A JSON string (closed, or running to the end of the text), or one bracket.
_JSON_PIECES = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[{}\[\]]', re.DOTALL)


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at ``text[start]`` ends (one past its last
    character), or None while it is not whole."""
    depth = 0
    for match in _JSON_PIECES.finditer(text, start):
        piece = match.group()
        if piece in "{[":
            depth += 1
        elif piece in "}]":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


class _Reader:
    """A cursor over the text after the trigger; ``need`` reports whether a literal
    follows: "yes" (consumed), "partial" (the text ends inside it) or "no"."""

    def __init__(self, text: str, position: int) -> None:
        self.text, self.position = text, position

    def need(self, literal: str) -> str:
        rest = self.text[self.position :]
        if rest.startswith(literal):
            self.position += len(literal)
            return "yes"
        return "partial" if literal.startswith(rest) else "no"


def scan(syntax: CallSyntax, text: str, *, final: bool) -> Scan:
    """Read ``text`` (a whole reply when ``final``, else what has streamed so far). While
    not final, content that could still turn out to begin the trigger is held back."""
    if syntax is GENERIC:
        if text.startswith(CONTENT_HEAD) or (CONTENT_HEAD.startswith(text) and not final):
            return Scan(content=json_string_prefix(text[len(CONTENT_HEAD) :]))
        if not text.startswith(GENERIC.prefix) and not final:
            return Scan()  # still a prefix of both heads, or of the calls' head
        start = 0 if text.startswith(GENERIC.prefix) else -1
    else:
        start = text.find(syntax.trigger)
    if start < 0:
        return Scan(content=text if final else text[: len(text) - _held(text, syntax.trigger)])
    result = Scan(content=text[:start])
    reader = _Reader(text, start)
    if _read_calls(syntax, reader, result) == "no":
        result.broken = True
    return result


def _read_calls(syntax: CallSyntax, reader: _Reader, result: Scan) -> str:
    """Read calls into ``result``; "yes" once the suffix is read, else where it stopped."""
    step = reader.need(syntax.prefix + CALL_HEAD)
    while step == "yes":
        call = PartialCall()
        result.calls.append(call)
        end = reader.text.find('"', reader.position)
        if end < 0:
            return "partial"
        call.name = reader.text[reader.position : end]
        reader.position = end
        step = reader.need(f'", "{syntax.arguments_key}": ')
        if step != "yes":
            return step
        close = _value_end(reader.text, reader.position)
        call.arguments = reader.text[reader.position : close]
        if close is None:
            return "partial"
        reader.position = close
        step = reader.need("}")
        if step != "yes":
            return step
        call.complete = True
        more = "no"
        if syntax.max_calls is None or len(result.calls) < syntax.max_calls:
            more = reader.need(syntax.separator + CALL_HEAD)
            if more == "yes":
                continue
        closing = reader.need(syntax.suffix)  # may begin the separator: so tried second
        result.closed = closing == "yes"
        return "yes" if result.closed else ("partial" if "partial" in (more, closing) else "no")
    return step


def _held(text: str, trigger: str) -> int:
    """How many characters at the end of ``text`` could begin ``trigger``."""
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0


# A JSON string's body as far as its characters are whole: plain characters and complete
# escapes, stopping at the closing quote or at an escape cut short.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')
_HIGH_SURROGATE_TAIL = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")


def json_string_prefix(raw: str) -> str:
    """The characters of the JSON string that ``raw`` begins (from its opening quote) as
    far as they are whole: an escape cut short, or half a surrogate pair, waits."""
    if not raw.startswith('"'):
        return ""
    match = _STRING_BODY.match(raw, 1)
    body = match.group() if match else ""
    if _HIGH_SURROGATE_TAIL.search(body):
        body = body[:-6]
    try:
        decoded: str = json.loads(f'"{body}"')
    except ValueError:  # not JSON the grammar wrote: show it as it is
        return body
    return decoded
