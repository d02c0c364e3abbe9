"""One pydantic validation failure as one 400: the field it names (``param``, a dotted path
such as ``messages.0.content``) and a message that says what was expected and what came.

Request bodies are validated strictly (`schemas.Body`): an integer is never a boolean or a
string, a number never a boolean, a boolean only ``true`` or ``false``. A failure inside a
union (``prompt``: a string, or arrays of strings, of token ids, of arrays of token ids)
gives one error per member of the union; the one reported is the deepest (the member the
value came closest to), and members that fail at the same place are merged into one
"expected …" list. The union members' own names (pydantic's ``list[int]``,
``NamedToolChoice``) never appear in ``param``. Shared by every route's body: OpenAI's
(`errors.validation_handler`), the Responses API's and Anthropic's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# pydantic's error type → what the field takes, in JSON's words.
EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}
# The names pydantic gives the members of a union in an error's location.
_BUILTIN_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "null"})
_GENERIC_TAG = re.compile(r"^[A-Za-z-]+\[.*\]$")  # list[int], literal['a'], function-after[…]
_MODEL_TAG = re.compile(r"^[A-Z][A-Za-z0-9]*$")  # NamedToolChoice (fields are snake_case)


@dataclass(frozen=True)
class Failure:
    """What one invalid body is answered with: ``param`` (None: the body as a whole)."""

    param: str | None
    message: str


def json_kind(value: Any) -> str:
    """The JSON type of a decoded value, as an error message says it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in _BUILTIN_TAGS or bool(_GENERIC_TAG.match(part)) or bool(_MODEL_TAG.match(part))
    )


def _location(error: Any) -> tuple[list[Any], list[str]]:
    """The error's raw location (without ``body``) and the path it names (union tags
    dropped, an `InvalidText`'s place inside the value added)."""
    raw = [part for part in error.get("loc", ()) if part != "body"]
    path = [str(part) for part in raw if not _is_tag(part)]
    cause = error.get("ctx", {}).get("error") if isinstance(error.get("ctx"), dict) else None
    path += [str(part) for part in getattr(cause, "path", ())]
    return raw, path


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _detail(error: Any) -> str:
    kind = error.get("type", "")
    if kind == "value_error" and "ctx" in error:
        return str(error["ctx"]["error"])  # our own validator's message, without a prefix
    if kind == "missing":
        return "this field is required"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"expected {expected}, got {_shown(error.get('input'))}"
    if kind in EXPECTED:
        value = error.get("input")
        return f"expected {EXPECTED[kind]}, got {json_kind(value)} ({_shown(value)})"
    return str(error.get("msg", "invalid value"))


def _either(items: list[str]) -> str:
    unique = list(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]


def describe(errors: Sequence[Any]) -> Failure:
    """The one failure to report of pydantic's ``errors`` (`ValidationError.errors()`)."""
    if not errors:
        return Failure(None, "invalid request body")
    located = [(error, *_location(error)) for error in errors]
    depth = max(len(raw) for _, raw, _ in located)
    deepest = [(error, path) for error, raw, path in located if len(raw) == depth]
    first, path = deepest[0]
    same_place = [error for error, other in deepest if other == path]
    param = ".".join(path) or None
    if len(same_place) > 1 and all(e.get("type") in EXPECTED for e in same_place):
        value = first.get("input")
        expected = _either([EXPECTED[e["type"]] for e in same_place])
        detail = f"expected {expected}, got {json_kind(value)} ({_shown(value)})"
    else:
        detail = _detail(first)
    message = f"{param}: {detail}" if param else f"invalid request body: {detail}"
    return Failure(param, message)
