"""The request shapes of OpenAI tool calling, validated with pydantic: the ``tools`` a chat
request offers, its ``tool_choice``, and the ``tool_calls`` an assistant message made.

Only shapes here, each failure a 400 naming its field (``tools.0.function.name``). What the
shapes mean together (a named function that must be in ``tools``, a tool result that must
answer an earlier call, a schema the grammar engine must compile) is `tools`'s to check.
Strings are checked for valid Unicode by the request body that holds these (`schemas.Body`
checks a field's whole value).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's rule for function names; it also keeps a name safe to write into a grammar.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # as `schemas.Body`


class FunctionSpec(_Shape):
    """A function the model may call: its name, what it does, and its arguments' JSON
    Schema (an object schema; none: it takes no arguments)."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is constrained to the schema whatever this says

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (value or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"a function's parameters are an object schema, not type {kind!r}")
        return value

    def arguments_schema(self) -> dict[str, Any]:
        """The schema a call's arguments must validate against (none given: ``{}`` only)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return {"type": "object", **self.parameters}


class ToolSpec(_Shape):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Shape):
    name: str


class NamedToolChoice(_Shape):
    """``tool_choice`` naming the one function the reply must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Shape):
    name: str
    arguments: str  # JSON text, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise ValueError(f"the arguments are not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("the arguments are JSON, but not an object")
        return value

    def parsed_arguments(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.arguments) if self.arguments.strip() else {}
        return parsed


class ToolCall(_Shape):
    """One call an assistant message made, sent back in the conversation."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall
