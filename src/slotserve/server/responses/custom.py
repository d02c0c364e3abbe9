"""The Responses API's custom tools: a tool (``{"type": "custom", "name", "description",
"format"}``) that takes one string, its ``input``: unconstrained (``format`` absent or
``{"type": "text"}``), a whole match of a regular expression (``{"type": "grammar",
"syntax": "regex", "definition": ...}``, Rust ``regex`` syntax as llguidance reads it), or
a string of a Lark grammar's language (``"syntax": "lark"``, llguidance's Lark).

The model calls a custom tool as it calls a function, in its template's call syntax, with
the arguments ``{"input": "<the input>"}``: the chat machinery (the call grammar, the reply
reader, the stream) runs unchanged, and the reply's call becomes a ``custom_tool_call``
item whose ``input`` is that string (`input_of`). A regular expression constrains the
string through JSON Schema's ``pattern`` (anchored at both ends), so it is compiled, bounded
and cached as every tool's arguments schema is (`tools.tool_grammar`: the grammar worker
pool, the grammar cache, the time and size bounds); one llguidance refuses is a 400 naming
``tools.N.format.definition``.

A Lark grammar cannot be a ``pattern`` (llguidance JSON-quotes one lexeme, not a
context-free language), so its rules are rewritten over the JSON-escaped text of its
language (`lark_json.escaped_rules`) and written between the quotes of the call's
arguments (`lark_arguments`: `tool_formats.LarkArguments`). The client's grammar is
compiled on its own first, through the same pool, cache and bounds; what llguidance refuses
there, and what the rewrite cannot carry over faithfully (imports, ``%ignore``, templates,
lexeme options, priorities, ``~``, ``&``, special tokens, case-insensitive literals,
regular expression flags, anchors, lookarounds, backreferences, Unicode classes), is a 400
naming ``tools.N.format.definition``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from slotserve.server.chat.tool_formats import LarkArguments, json_string_prefix
from slotserve.server.http.errors import APIError
from slotserve.server.responses.lark_json import UnsupportedLark, escaped_rules, literal

INVALID = "invalid_request_error"
INPUT_KEY = "input"
# The head of a custom call's arguments as the call grammar writes them (its fixed JSON
# separators: `tool_formats.JSON_OPTIONS`).
_HEAD = '{"' + INPUT_KEY + '": '


def _refuse(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", INVALID, param)


def input_schema(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """The JSON Schema of a custom tool's call arguments (``{"input": <string>}``, the
    string a whole match of its regular expression when it has one; a Lark grammar
    constrains it through `lark_arguments` instead); a format this server cannot constrain
    is a 400 naming its field."""
    text: dict[str, Any] = {"type": "string"}
    form = tool.get("format")
    param = f"tools.{index}.format"
    if form is not None:
        if not isinstance(form, dict):
            raise _refuse(param, "expected an object")
        kind = form.get("type")
        if kind == "grammar":
            syntax, definition = form.get("syntax"), form.get("definition")
            if syntax not in ("lark", "regex"):
                raise _refuse(f"{param}.syntax", f'expected "lark" or "regex", got {syntax!r}')
            if not isinstance(definition, str):
                raise _refuse(f"{param}.definition", "expected the grammar's text (a string)")
            if syntax == "regex":
                text["pattern"] = f"^(?:{definition})$"
        elif kind != "text":
            raise _refuse(f"{param}.type", f'expected "text" or "grammar", got {kind!r}')
    return {
        "type": "object",
        "properties": {INPUT_KEY: text},
        "required": [INPUT_KEY],
        "additionalProperties": False,
    }


def custom_function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A custom tool as chat's function (its name, description, arguments' schema)."""
    function: dict[str, Any] = {k: tool[k] for k in ("name", "description") if k in tool}
    return {**function, "parameters": input_schema(tool, index)}


def lark_arguments(tools: Sequence[dict[str, Any]] | None) -> dict[str, LarkArguments]:
    """The call arguments of the custom tools with a Lark grammar (by name): the grammar's
    escaped rules between the quotes of ``{"input": "..."}``. A grammar the rewrite cannot
    carry over is a 400 naming its ``tools.N.format.definition``."""
    found = {}
    for index, tool in enumerate(tools or ()):
        form = tool.get("format")
        if tool.get("type") != "custom" or not isinstance(form, dict):
            continue
        if form.get("type") != "grammar" or form.get("syntax") != "lark":
            continue
        source = str(form.get("definition"))  # a string: `input_schema` checked it
        prefix = f"c{index}_"  # apart from the call grammar's names (`LarkArguments`)
        try:
            rules = escaped_rules(source, prefix)
        except UnsupportedLark as exc:
            raise _refuse(f"tools.{index}.format.definition", str(exc)) from None
        head, tail = literal(_HEAD + '"'), literal('"}')
        entry = f"{prefix}arguments"
        rules += f"{entry}: {head} {prefix}start {tail}\n"
        found[str(tool.get("name"))] = LarkArguments(rules, entry, source)
    return found


def custom_names(tools: Sequence[dict[str, Any]] | None) -> frozenset[str]:
    """The names of the custom tools among ``tools``."""
    return frozenset(str(tool.get("name")) for tool in tools or () if tool.get("type") == "custom")


def call_arguments(text: str) -> str:
    """A custom call's ``input`` as the call arguments the chat template renders."""
    return json.dumps({INPUT_KEY: text}, ensure_ascii=False)


def input_of(arguments: str) -> str:
    """The ``input`` a custom call's arguments hold, whole or as far as they are written
    (a call cut short by the token budget, or one still streaming): an escape cut short,
    or half a surrogate pair, is left out until it is whole."""
    if not arguments.startswith(_HEAD):
        return ""
    return json_string_prefix(arguments[len(_HEAD) :])


def custom_item(name: str, text: str, call_id: str | None = None) -> dict[str, Any]:
    """A ``custom_tool_call`` output item (`ResponseCustomToolCall`)."""
    return {
        "id": f"ctc_{uuid.uuid4().hex}",
        "type": "custom_tool_call",
        "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": text,
    }
