"""`start_chat`: a chat request on the engine, whatever API it came in through (OpenAI's
chat completions, the Responses API, Anthropic's Messages): the one path every chat takes.
Its tools planned (once), its prompt rendered (with its ``chat_template_kwargs``) and
tokenised once, its grammar compiled (the tool calls', else the output constraint's:
``response_format`` and the peers' fields), its reply's thinking section planned
(`reasoning`), its choices submitted; a request it refuses is refused before any choice
is submitted. What answers it is the caller's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import Request

from slotserve.engine import Engine, Finished, RequestHandle
from slotserve.sampling import Grammar
from slotserve.server.chat.reasoning import Reasoning, ReasoningFormat, plan_reasoning, thinks
from slotserve.server.chat.reply import ReplyShape
from slotserve.server.chat.samplers import chain_fields
from slotserve.server.chat.structured import (
    SCHEMA_PARAM,
    logit_bias,
    output_refusal,
    request_constraint,
    response_grammar,
)
from slotserve.server.chat.tool_formats import LarkArguments
from slotserve.server.chat.tools import ToolPlan, plan_tools, tool_grammar
from slotserve.server.http.errors import APIError
from slotserve.server.http.generation import submit_all
from slotserve.server.http.state import ServerState
from slotserve.server.openai.completions import (
    chat_tokens,
    check_finish,
    priority_of,
    prompt_tokens,
    sampling_params,
)
from slotserve.server.openai.schemas import ChatCompletionRequest
from slotserve.tokenizer import Tokenizer


@dataclass
class ChatRun:
    """A submitted chat request: its choices' handles, its tool plan (None: no tools), how
    its reply is read (`ReplyShape`: call syntax, thinking section, special tokens written
    back) and its prompt's length; ``constraint``: the grammar of its output constraint
    (None: none, or tools, whose own grammar decides), given by field ``constraint_param``."""

    handles: list[RequestHandle]
    plan: ToolPlan | None
    shape: ReplyShape
    prompt_tokens: int
    constraint: Grammar | None = None
    constraint_param: str = SCHEMA_PARAM

    @property
    def reasoning(self) -> Reasoning | None:
        return self.shape.reasoning

    def refusal(self, final: Finished) -> APIError | None:
        """The error for a choice that ended with a document its output constraint does not
        accept (`structured.output_refusal`); None for any other end."""
        return output_refusal(self.constraint, final, self.constraint_param)

    def check(self, final: Finished) -> None:
        """Raise the error of a choice that did not end well: the engine's (`check_finish`)
        or a document its output constraint refuses (`refusal`), never reported as a
        finished reply. Every API calls it at each choice's end."""
        check_finish(final)
        refusal = self.refusal(final)
        if refusal is not None:
            raise refusal


def reasoning_format(state: ServerState, chat: ChatCompletionRequest) -> ReasoningFormat:
    """The request's ``reasoning_format``, else the server's (``--reasoning-format``)."""
    return chat.reasoning_format or state.reasoning_format


def reads_reasoning(
    tokenizer: Tokenizer, state: ServerState, chat: ChatCompletionRequest, plan: ToolPlan | None
) -> bool:
    """Whether ``chat``'s reply is read for a thinking section: the model thinks, the format
    is not ``none``, and no grammar constrains the reply from its first token (a
    ``response_format`` or another constraint, a ``required`` or named tool choice: the
    document comes at once)."""
    structured = request_constraint(chat) is not None
    constrained = structured or (plan is not None and plan.mode == "required")
    return reasoning_format(state, chat) != "none" and thinks(tokenizer) and not constrained


def chat_prompt(
    engine: Engine, chat: ChatCompletionRequest, param: str
) -> tuple[list[int], ToolPlan | None]:
    """``chat``'s prompt tokens and tool plan; a prompt too long is a 400 naming ``param``."""
    plan = plan_tools(engine.model.tokenizer, chat)
    return _prompt(engine, chat, plan, param), plan


def _prompt(
    engine: Engine, chat: ChatCompletionRequest, plan: ToolPlan | None, param: str
) -> list[int]:
    """``chat``'s messages, offering ``plan``'s tools, as checked prompt tokens."""
    prompt = chat_tokens(
        engine,
        chat.messages,
        add_generation_prompt=True,
        tools=plan,
        template_kwargs=chat.chat_template_kwargs,
    )
    return prompt_tokens(engine, prompt, param)


async def start_chat(
    state: ServerState,
    engine: Engine,
    chat: ChatCompletionRequest,
    request: Request,
    param: str = "messages",
    lark: Mapping[str, LarkArguments] | None = None,
) -> ChatRun:
    """Submit ``chat`` (``param``: the field its messages came in, for refusals; ``lark``:
    the tools whose arguments are Lark rules, `tools.tool_grammar`). The
    request's own refusals come in this order: ``n``, its tools, two output constraints,
    its messages (the template), its prompt's length, its grammar, its sampling fields, its
    class (``priority``), then admission."""
    n = chat.n or 1
    if n > engine.config.max_seqs:
        message = f"n={n} exceeds this server's max_seqs={engine.config.max_seqs}"
        raise APIError(400, message, "invalid_request_error", param="n")
    tokenizer = engine.model.tokenizer
    plan = plan_tools(tokenizer, chat)
    constraint = request_constraint(chat)  # two constraints: a 400 before the template runs
    thinking = reads_reasoning(tokenizer, state, chat, plan)
    tokens = _prompt(engine, chat, plan, param)
    grammars = state.grammars_of(engine)
    grammar: Grammar | None
    if plan is not None:
        grammar = await tool_grammar(grammars, plan, tokenizer, request, lark)
    else:
        grammar = await response_grammar(grammars, chat, request)
    room = engine.config.max_context - len(tokens)
    bias = logit_bias(engine, chat)
    chain = await asyncio.to_thread(chain_fields, tokenizer, chat)  # DRY reads the vocabulary
    params = [
        sampling_params(chat, room, i, state.sampling, grammar, bias, chain) for i in range(n)
    ]
    reasoning = None
    if thinking:
        reasoning = plan_reasoning(tokenizer, tokens, reasoning_format(state, chat))
    markers = {} if plan is None else plan.markers(tokenizer)
    markers |= reasoning.markers if reasoning is not None else {}
    shape = ReplyShape(plan.syntax if plan is not None else None, reasoning, markers)
    handles = submit_all(
        engine, tokens, params, priority_of(chat, request), param, keep_conversation=True
    )
    checked = grammar if plan is None else None
    given_by = constraint.param if constraint is not None else SCHEMA_PARAM
    return ChatRun(handles, plan, shape, len(tokens), checked, given_by)
