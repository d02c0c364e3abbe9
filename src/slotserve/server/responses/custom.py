"""The Responses API's custom tools: a tool (``{"type": "custom", "name", "description",
"format"}``) that takes one string, its ``input``, unconstrained (``format`` absent or
``{"type": "text"}``) or a whole match of a regular expression (``{"type": "grammar",
"syntax": "regex", "definition": ...}``, Rust ``regex`` syntax as llguidance reads it).

The model calls a custom tool as it calls a function, in its template's call syntax, with
the arguments ``{"input": "<the input>"}``: the chat machinery (the call grammar, the reply
reader, the stream) runs unchanged, and the reply's call becomes a ``custom_tool_call``
item whose ``input`` is that string (`input_of`). A regular expression constrains the
string through JSON Schema's ``pattern`` (anchored at both ends), so it is compiled, bounded
and cached as every tool's arguments schema is (`tools.tool_grammar`: the grammar worker
pool, the grammar cache, the time and size bounds); one llguidance refuses is a 400 naming
``tools.N.format.definition``.

``syntax: "lark"`` is refused (400 naming ``tools.N.format.syntax``): the input is a JSON
string inside the call, and llguidance quotes a single lexeme as JSON, not a context-free
language, so a Lark grammar cannot constrain it there.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from slotserve.server.chat.tool_formats import json_string_prefix
from slotserve.server.http.errors import APIError

INVALID = "invalid_request_error"
INPUT_KEY = "input"
# The head of a custom call's arguments as the call grammar writes them (its fixed JSON
# separators: `tool_formats.JSON_OPTIONS`).
_HEAD = '{"' + INPUT_KEY + '": '


def _refuse(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", INVALID, param)


def input_schema(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """The JSON Schema of a custom tool's call arguments (``{"input": <string>}``, the
    string a whole match of its regular expression when it has one); a format this server
    cannot constrain is a 400 naming its field."""
    text: dict[str, Any] = {"type": "string"}
    form = tool.get("format")
    param = f"tools.{index}.format"
    if form is not None:
        if not isinstance(form, dict):
            raise _refuse(param, "expected an object")
        kind = form.get("type")
        if kind == "grammar":
            syntax, definition = form.get("syntax"), form.get("definition")
            if syntax == "lark":
                raise _refuse(
                    f"{param}.syntax",
                    "Lark grammars are not supported for custom tools here (the input is a "
                    "JSON string inside the model's call, which llguidance can constrain to a "
                    'regular expression but not to a Lark grammar); use "syntax": "regex", '
                    "or a function tool",
                )
            if syntax != "regex":
                raise _refuse(f"{param}.syntax", f'expected "lark" or "regex", got {syntax!r}')
            if not isinstance(definition, str):
                raise _refuse(f"{param}.definition", "expected the grammar's text (a string)")
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
