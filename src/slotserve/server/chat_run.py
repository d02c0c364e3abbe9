"""`start_chat`: a chat request on the engine, whatever API it came in through (OpenAI's
chat completions with tools, the Responses API, Anthropic's Messages): its tools planned,
its prompt rendered and tokenised once, its grammar compiled (the tool calls', else
``response_format``'s), its choices submitted. What answers it is the caller's."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from slotserve.engine import Engine, RequestHandle, TokenEvent
from slotserve.sampling import Grammar
from slotserve.server.completions import (
    chat_tokens,
    priority_of,
    prompt_tokens,
    sampling_params,
)
from slotserve.server.errors import APIError
from slotserve.server.generation import submit_all
from slotserve.server.schemas import ChatCompletionRequest
from slotserve.server.state import ServerState
from slotserve.server.structured import logit_bias, response_grammar
from slotserve.server.tools import ToolPlan, plan_tools, tool_grammar


@dataclass
class ChatRun:
    """A submitted chat request: its choices' handles, its tool plan (None: no tools), the
    special tokens its call syntax writes (id → text) and its prompt's length."""

    handles: list[RequestHandle]
    plan: ToolPlan | None
    markers: dict[int, str]
    prompt_tokens: int

    def text(self, events: list[TokenEvent]) -> str:
        """A reply's text, with the call syntax's special tokens written back."""
        return "".join(event.text + self.markers.get(event.token_id, "") for event in events)


def chat_prompt(
    engine: Engine, chat: ChatCompletionRequest, param: str
) -> tuple[list[int], ToolPlan | None]:
    """``chat``'s prompt tokens and tool plan; a prompt too long is a 400 naming ``param``."""
    plan = plan_tools(engine.model.tokenizer, chat)
    prompt = chat_tokens(engine, chat.messages, add_generation_prompt=True, tools=plan)
    return prompt_tokens(engine, prompt, param), plan


async def start_chat(
    state: ServerState,
    engine: Engine,
    chat: ChatCompletionRequest,
    request: Request,
    param: str = "messages",
) -> ChatRun:
    """Submit ``chat`` (``param``: the field its messages came in, for refusals)."""
    n = chat.n or 1
    if n > engine.config.max_seqs:
        message = f"n={n} exceeds this server's max_seqs={engine.config.max_seqs}"
        raise APIError(400, message, "invalid_request_error", param="n")
    tokens, plan = chat_prompt(engine, chat, param)
    tokenizer = engine.model.tokenizer
    grammars = state.grammars_of(engine)
    grammar: Grammar | None
    if plan is not None:
        grammar = await tool_grammar(grammars, plan, tokenizer)
    else:
        grammar = await response_grammar(grammars, chat)
    room = engine.config.max_context - len(tokens)
    bias = logit_bias(engine, chat)
    params = [sampling_params(chat, room, i, state.sampling, grammar, bias) for i in range(n)]
    handles = submit_all(
        engine, tokens, params, priority_of(chat, request), param, keep_conversation=True
    )
    markers = {} if plan is None else {t: s for s, t in plan.specials(tokenizer).items()}
    return ChatRun(handles, plan, markers, len(tokens))
