"""Tool calling, the request's side: what a chat request's ``tools`` and ``tool_choice`` ask
of its reply (`ToolPlan`), the conversation as the chat template reads it (assistant
``tool_calls``, ``tool`` results, the tools themselves), and the grammar the reply is
decoded under.

The chat template renders the tools when it takes the ``tools`` variable and writes a call
syntax known here (`tool_formats.template_syntax`); otherwise the tools go into a system
instruction and the reply is one JSON object (`tool_formats.GENERIC`). Every refusal is a
400 naming the field: a schema the grammar engine cannot compile, a named function missing
from ``tools``, a ``tool`` message that answers no earlier call. Owns no state: grammars
are compiled by the served model's `GrammarCache` compiler.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from fastapi import Request

from slotserve.sampling import Grammar
from slotserve.server.chat.reasoning import CLOSE, OPEN, thinks
from slotserve.server.chat.structured import GrammarCache, compiled, request_constraint
from slotserve.server.chat.tool_formats import (
    GENERIC,
    HERMES,
    CallSyntax,
    LarkArguments,
    Mode,
    call_grammar,
    template_syntax,
)
from slotserve.server.http.errors import APIError
from slotserve.server.openai.schemas import ChatCompletionRequest, ChatMessage
from slotserve.server.openai.tool_specs import FunctionSpec, NamedToolChoice
from slotserve.tokenizer import Tokenizer

INVALID = "invalid_request_error"
REFUSED = "invalid_schema"  # the code of a tool's schema the grammar engine refuses


@dataclass(frozen=True)
class ToolPlan:
    """How one chat reply may call tools: ``callable`` (all the request's tools, or the one
    ``tool_choice`` names), ``mode`` (``auto``: it may answer instead; ``required``: it
    calls from the first token), ``parallel`` (more than one call), the ``syntax`` it
    writes and whether the chat template renders the tools itself (``native``)."""

    offered: tuple[FunctionSpec, ...]
    callable: tuple[FunctionSpec, ...]
    mode: Mode
    parallel: bool
    syntax: CallSyntax
    native: bool

    def specials(self, tokenizer: Tokenizer) -> dict[str, int]:
        """The syntax's literals that are one added token of ``tokenizer`` (text → id),
        special or not (Qwen3's ``<tool_call>`` is not): the grammar engine reads every
        added token as a token apart from text, so the grammar writes them as that token."""
        if not self.native:
            return {}
        texts = (self.syntax.trigger, "</tool_call>") if self.syntax is HERMES else ()
        return added_tokens(tokenizer, texts or (self.syntax.trigger,))

    def markers(self, tokenizer: Tokenizer) -> dict[int, str]:
        """The `specials` that are special tokens (id → text): the engine's text leaves
        them out, and a reply's text gets them back."""
        return {t: text for text, t in self.specials(tokenizer).items() if tokenizer.is_special(t)}


def added_tokens(tokenizer: Tokenizer, texts: Sequence[str]) -> dict[str, int]:
    """Those of ``texts`` that are one added token of ``tokenizer`` (text → id)."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder() if isinstance(backend, tokenizers.Tokenizer) else {}
    found: dict[str, int] = {}
    for text in texts:
        token = tokenizer.token_to_id(text)
        if token is not None and (tokenizer.is_special(token) or token in added):
            found[text] = token
    return found


@functools.lru_cache(maxsize=8)
def takes_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable."""
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def chat_syntax(tokenizer: Tokenizer) -> tuple[CallSyntax, bool]:
    """The call syntax of this model's chat template, and whether it is the template's own
    (else `GENERIC`)."""
    template = tokenizer.chat_template
    native = template_syntax(template, takes_tools(template)) if template else None
    return (native, True) if native is not None else (GENERIC, False)


def plan_tools(tokenizer: Tokenizer, body: ChatCompletionRequest) -> ToolPlan | None:
    """What ``body``'s tools ask of its reply; None when it may not call any (no tools, or
    ``tool_choice: "none"``). Checks every field that names a tool."""
    tools = body.tools or []
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if not tools:
        if choice == "required" or named is not None:
            raise APIError(400, "tool_choice: there are no tools to call", INVALID, "tool_choice")
        return None
    functions = [tool.function for tool in tools]
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if function.name in seen:
            param = f"tools.{index}.function.name"
            raise APIError(400, f"{param}: {function.name!r} is given twice", INVALID, param)
        seen.add(function.name)
    if choice == "none":
        return None
    constraint = request_constraint(body)
    structured = constraint.param if constraint is not None else "response_format"
    for param, given in ((structured, constraint is not None), ("ignore_eos", body.ignore_eos)):
        if given:
            message = f"{param}: cannot be combined with tools (the tool-call grammar decides)"
            raise APIError(400, message, INVALID, param)
    callable_ = functions
    if named is not None:
        callable_ = [f for f in functions if f.name == named]
        if not callable_:
            param = "tool_choice.function.name"
            message = f"{param}: {named!r} is not one of the tools {sorted(seen)}"
            raise APIError(400, message, INVALID, param)
    syntax, native = chat_syntax(tokenizer)
    return ToolPlan(
        offered=tuple(functions),
        callable=tuple(callable_),
        mode="required" if choice == "required" or named is not None else "auto",
        parallel=body.parallel_tool_calls is not False and named is None,
        syntax=syntax,
        native=native,
    )


async def tool_grammar(
    grammars: GrammarCache,
    plan: ToolPlan,
    tokenizer: Tokenizer,
    request: Request | None = None,
    lark: Mapping[str, LarkArguments] | None = None,
) -> Grammar:
    """The grammar of ``plan``'s reply, compiled in ``grammars``' bounded pool as a
    ``response_format`` schema is (time and memory bounds, a queue deadline, cancelled when
    the client disconnects). ``lark``: the functions (by name) whose arguments are Lark
    rules instead of their schema (a Responses custom tool's). Each function's schema, or
    the Lark grammar its rules came from, is compiled on its own first (and cached), so one
    the grammar engine refuses is a 400 naming that tool; then the reply's grammar, which
    holds them all."""
    lark = lark or {}
    arguments = {f.name: lark.get(f.name) or f.arguments_schema() for f in plan.callable}
    for index, function in enumerate(plan.offered):
        if function in plan.callable:
            given = arguments[function.name]
            lookup = (
                functools.partial(grammars.lookup_grammar, given.source, "Lark grammar")
                if isinstance(given, LarkArguments)
                else functools.partial(grammars.lookup, given)
            )
            param = f"tools.{index}.function.parameters"
            await compiled(grammars, lookup, request, param, REFUSED)
    # A thinking model's tags may come before a call, in the free text (`reasoning`).
    tags = added_tokens(tokenizer, (OPEN, CLOSE)) if thinks(tokenizer) else {}
    text = call_grammar(
        plan.syntax,
        [(f.name, arguments[f.name]) for f in plan.callable],
        mode=plan.mode,
        parallel=plan.parallel,
        specials=plan.specials(tokenizer),
        free_tokens=tuple(tags.values()),
    )
    return await compiled(
        grammars, lambda: grammars.lookup_grammar(text, "tool calls"), request, "tools", REFUSED
    )


# -- the conversation, as the template reads it ----------------------------------------


@dataclass(frozen=True)
class TemplateInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # the template's ``tools`` variable


def template_input(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], plan: ToolPlan | None
) -> TemplateInput:
    """``messages`` (and ``plan``'s tools) as the chat template reads them. A ``tool``
    message must answer a call an earlier assistant message made (400 naming it)."""
    native = plan.native if plan is not None else chat_syntax(tokenizer)[1]
    names = _check_results(messages)
    if native:
        rendered = [_native_message(message, names) for message in messages]
    else:
        rendered = _generic_messages(messages, names)
    tools = None
    if plan is not None and native:
        tools = [{"type": "function", "function": _function_view(f)} for f in plan.offered]
    elif plan is not None:
        rendered = _with_instruction(rendered, generic_instruction(plan))
    return TemplateInput(rendered, tools)


def _check_results(messages: Sequence[ChatMessage]) -> dict[str, str]:
    """Each call id → its function's name; raises for a ``tool`` message that answers no
    call made before it, and for content that is not text."""
    names: dict[str, str] = {}
    for index, message in enumerate(messages):
        try:
            message.text()
        except ValueError as exc:  # a content part that is not text
            param = f"messages.{index}.content"
            raise APIError(400, f"{param}: {exc}", INVALID, param) from None
        for call in message.tool_calls or []:
            names[call.id] = call.function.name
        if message.role == "tool" and message.tool_call_id not in names:
            param = f"messages.{index}.tool_call_id"
            given = message.tool_call_id
            reason = "is missing" if given is None else f"{given!r} answers no earlier tool call"
            raise APIError(400, f"{param}: {reason}", INVALID, param)
    return names


def _native_message(message: ChatMessage, names: dict[str, str]) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                # Templates write arguments with |tojson, as transformers passes them.
                "function": {
                    "name": call.function.name,
                    "arguments": call.function.parsed_arguments(),
                },
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        assert message.tool_call_id is not None  # _check_results
        rendered["tool_call_id"] = message.tool_call_id
        rendered["name"] = message.name or names[message.tool_call_id]
    return _with_reasoning(rendered, message)


def _with_reasoning(rendered: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """``rendered`` with the turn's past thinking as ``reasoning_content``, the variable
    templates that render past reasoning read (Qwen3's, inside a tool loop), as llama.cpp's
    server passes it; templates that do not read it render as before."""
    reasoning = message.past_reasoning()
    if reasoning:
        rendered["reasoning_content"] = reasoning
    return rendered


def _generic_messages(
    messages: Sequence[ChatMessage], names: dict[str, str]
) -> list[dict[str, Any]]:
    """``messages`` for a template that knows no tools: calls as the JSON the reply format
    writes, results as user turns (consecutive results in one)."""
    rendered: list[dict[str, Any]] = []
    after_result = False
    for message in messages:
        if message.role == "tool":
            assert message.tool_call_id is not None  # _check_results
            result = {
                "id": message.tool_call_id,
                "name": message.name or names[message.tool_call_id],
                "content": message.text(),
            }
            line = json.dumps({"tool_response": result}, ensure_ascii=False)
            if after_result:
                rendered[-1]["content"] += "\n" + line
            else:
                rendered.append({"role": "user", "content": line})
            after_result = True
            continue
        after_result = False
        content = message.text()
        if message.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": c.function.parsed_arguments(), "id": c.id}
                for c in message.tool_calls
            ]
            reply: dict[str, Any] = {"content": content} if content else {}
            content = json.dumps({**reply, "tool_calls": calls}, ensure_ascii=False)
        rendered.append(_with_reasoning({"role": message.role, "content": content}, message))
    return rendered


def _function_view(function: FunctionSpec) -> dict[str, Any]:
    view: dict[str, Any] = {"name": function.name}
    if function.description:
        view["description"] = function.description
    view["parameters"] = function.arguments_schema()
    return view


def generic_instruction(plan: ToolPlan) -> str:
    """The system instruction that offers ``plan``'s tools to a template without tools."""
    listing = json.dumps([_function_view(f) for f in plan.offered], ensure_ascii=False)
    call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    if len(plan.callable) == 1 and plan.mode == "required":
        answer = f"Answer only with a JSON object that calls {plan.callable[0].name}: {call}"
    elif plan.mode == "required":
        answer = f"Answer only with a JSON object that calls one or more of them: {call}"
    else:
        answer = (
            f"Answer with a JSON object: call one or more of them with {call}, "
            'or reply to the user with {"content": "<your reply>"}'
        )
    return f"You can call these functions:\n{listing}\n{answer}."


def _with_instruction(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    """``messages`` with ``instruction`` after the first system message's text (or as a new
    system message first)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = (
            f"{first['content']}\n\n{instruction}" if first["content"] else instruction
        )
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]
