"""Text completions over the engine (``/v1/completions``): the JSON answer and the SSE
stream; and what the chat path (`chat.run.start_chat`) shares with them: the chat
template's prompt, the prompt's checks, the sampling parameters, the request's class."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slotserve.engine import Engine, Finished, TokenEvent
from slotserve.engine.events import Priority, check_priority
from slotserve.sampling import Grammar, SamplingParams
from slotserve.server.chat.defaults import SamplingDefaults
from slotserve.server.chat.samplers import chain_fields
from slotserve.server.chat.structured import (
    SCHEMA_PARAM,
    logit_bias,
    output_refusal,
    request_constraint,
    response_grammar,
)
from slotserve.server.chat.tools import ToolPlan, template_input
from slotserve.server.http.errors import CONTEXT_LENGTH_EXCEEDED, APIError, error_body
from slotserve.server.http.generation import collect, merged, submit_all
from slotserve.server.http.state import ServerState
from slotserve.server.openai import replies as fmt
from slotserve.server.openai.llama_timings import at_end, at_token
from slotserve.server.openai.schemas import SEED_MAX, ChatMessage, CompletionRequest, SamplingFields
from slotserve.tokenizer import ChatTemplateMissing, Tokenizer

# What a chat template raises on purpose (its raise_exception()) to refuse a conversation:
# the client's to fix. Anything else a template raises is the template's fault.
TEMPLATE_REFUSAL = jinja2.TemplateError


_Rendered = TypeVar("_Rendered")


def chat_tokens(
    engine: Engine,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """``messages`` through the chat template, as token ids: the template's markers are
    special tokens, special-token text a client typed stays text. A conversation the
    template refuses on purpose (``raise_exception``) is the caller's (400); a template that
    fails otherwise (a type error, an undefined name, a syntax error) is the model's, 500
    ``template_error`` naming it. ``tools``: the tools the prompt offers (`tools.ToolPlan`);
    calls and tool results in ``messages`` are rendered either way (`tools.template_input`).
    ``template_kwargs``: the request's ``chat_template_kwargs`` (``enable_thinking``)."""
    tokenizer = engine.model.tokenizer
    return _templated(
        tokenizer.encode_chat, tokenizer, messages, add_generation_prompt, tools, template_kwargs
    )


def chat_text(
    engine: Engine,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text the chat template writes for what `chat_tokens` encodes (llama.cpp's
    ``/apply-template``), with the same refusals."""
    tokenizer = engine.model.tokenizer
    return _templated(
        tokenizer.render_chat, tokenizer, messages, add_generation_prompt, tools, template_kwargs
    )


def _templated(
    render: Callable[..., _Rendered],
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: ToolPlan | None,
    template_kwargs: dict[str, Any] | None,
) -> _Rendered:
    """``messages`` (and ``tools``) as the template takes them, through ``render`` (the
    tokenizer's `encode_chat` or `render_chat`), with its failures as HTTP errors."""
    rendered = template_input(tokenizer, messages, tools)  # its own 400s name the message
    try:
        return render(
            rendered.messages,
            add_generation_prompt=add_generation_prompt,
            tools=rendered.tools,
            template_kwargs=template_kwargs,
        )
    except ChatTemplateMissing as exc:  # the model's, not the messages': say what fixes it
        raise APIError(
            400, str(exc), "invalid_request_error", code="chat_template_missing"
        ) from None
    except Exception as exc:
        if type(exc) is TEMPLATE_REFUSAL:
            message = f"messages: {exc}"
            raise APIError(400, message, "invalid_request_error", param="messages") from None
        raise APIError(
            500,
            f"the model's chat template failed to render these messages "
            f"({type(exc).__name__}: {exc}); fix the template (serve --chat-template FILE)",
            "server_error",
            code="template_error",
        ) from None


def prompt_tokens(engine: Engine, prompt: str | list[int], param: str) -> list[int]:
    """The prompt as token ids, tokenised once here (the engine takes the ids as they are);
    a prompt that leaves no room to generate is refused as OpenAI does (400
    ``context_length_exceeded``, ``param`` naming the prompt's field)."""
    tokens = engine.model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    vocab = engine.model.info.vocab_size
    bad = next(((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"{param}: token id {bad[1]} (at index {bad[0]}) is not in this model's vocabulary "
            f"(0..{vocab - 1})",
            "invalid_request_error",
            param=param,
            code="invalid_value",
        )
    limit = engine.config.max_context
    if len(tokens) >= limit:
        raise APIError(
            400,
            f"{param}: the prompt is {len(tokens)} tokens, which leaves no room to generate "
            f"within max_context={limit}; shorten it to at most {limit - 1} tokens",
            "invalid_request_error",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return tokens


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def sampling_params(
    body: SamplingFields,
    room: int,
    choice: int,
    defaults: SamplingDefaults | None = None,
    grammar: Grammar | None = None,
    bias: tuple[tuple[int, float], ...] = (),
    chain: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's parameters for choice ``choice`` of ``body``: the request's fields, and
    the server's ``defaults`` for those it leaves out; ``chain``: its llama.cpp and vLLM
    samplers' (`samplers.chain_fields`)."""
    defaults = defaults or SamplingDefaults()
    budget = body.token_budget()
    seed = None if body.seed is None else _choice_seed(body.seed, choice)
    repetition = (
        body.repetition_penalty if body.repetition_penalty is not None else body.repeat_penalty
    )
    try:
        return SamplingParams(
            temperature=_given(body.temperature, defaults.temperature),
            top_p=max(_given(body.top_p, defaults.top_p), 1e-6),
            top_k=int(_given(body.top_k, defaults.top_k)),
            min_p=_given(body.min_p, defaults.min_p),
            repetition_penalty=_given(repetition, defaults.repetition_penalty),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=seed,
            max_new_tokens=budget if budget is not None else max(room, 0),
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            logprobs=body.logprobs_count(),
            logit_bias=bias,
            grammar=grammar,
            **(chain or {}),
        )
    except ValueError as exc:
        named = _PARAM_OF_SAMPLING.match(str(exc))
        param = _REQUEST_FIELD.get(named.group(1), named.group(1)) if named else None
        raise APIError(
            400, str(exc), "invalid_request_error", param=param, code="invalid_value"
        ) from None


# `SamplingParams` names the field it refuses first ("top_p=… is out of range"); the
# request's name for it, where it differs.
_PARAM_OF_SAMPLING = re.compile(r"^([a-z_]+)[= ]")
_REQUEST_FIELD = {"max_new_tokens": "max_tokens"}


def _choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice``: ``seed + choice``, wrapped into the 64-bit range the
    sampler takes (a seed of 2^64 - 1 with n = 2 stays valid)."""
    value = seed + choice
    return value - 2**64 if value > SEED_MAX else value


def priority_of(body: SamplingFields, request: Request) -> Priority:
    """The request's class: the body's ``priority``, else the ``X-Priority`` header."""
    value = body.priority or request.headers.get("x-priority") or "normal"
    try:
        return check_priority(value)
    except ValueError as exc:
        message = f"X-Priority: {exc}"
        raise APIError(400, message, "invalid_request_error", param="priority") from None


async def generate(
    state: ServerState, engine: Engine, body: CompletionRequest, request: Request
) -> Response:
    """Run a text completion (its prompt text, or token ids): a JSON answer or an SSE
    stream. Chat is `chat.run.start_chat`'s."""
    n = body.n or 1
    if n > engine.config.max_seqs:
        raise APIError(
            400,
            f"n={n} exceeds this server's max_seqs={engine.config.max_seqs}",
            "invalid_request_error",
            param="n",
        )
    tokens = prompt_tokens(engine, body.prompt_input(), "prompt")
    room = engine.config.max_context - len(tokens)
    grammar = await response_grammar(state.grammars_of(engine), body, request)
    constraint = request_constraint(body)
    grammar_param = constraint.param if constraint is not None else SCHEMA_PARAM
    bias = logit_bias(engine, body)
    chain = await asyncio.to_thread(
        chain_fields, engine.model.tokenizer, body
    )  # DRY reads the vocabulary
    params = [
        sampling_params(body, room, i, state.sampling, grammar, bias, chain) for i in range(n)
    ]
    # Everything the reply needs before the submit: after it, the route shares the GIL
    # and the cores with the step computing the first token.
    request_id = state.response_id("cmpl")
    created = int(time.time())
    handles = submit_all(engine, tokens, params, priority_of(body, request), "prompt")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(
            state, engine, handles, request_id, created, include_usage, body, grammar, grammar_param
        )
        return StreamingResponse(stream, media_type="text/event-stream")
    outcomes = await collect(handles, request)
    complete = _complete(state, engine, outcomes, request_id, created, body, grammar, grammar_param)
    return JSONResponse(complete)


def check_finish(final: Finished) -> None:
    """Raise the HTTP error for a request that did not end normally: an engine failure is
    500; a cancellation reaching a live response only comes from the server's shutdown
    (a client that went away has no response left), so it is 503."""
    if final.reason == "error":
        raise APIError(500, "generation failed on the device", "server_error")
    if final.reason == "cancelled":
        raise APIError(
            503, "the request was cancelled: the server is shutting down", "server_error"
        )


def _complete(
    state: ServerState,
    engine: Engine,
    outcomes: list[Any],
    request_id: str,
    created: int,
    body: CompletionRequest,
    grammar: Grammar | None = None,
    grammar_param: str = SCHEMA_PARAM,
) -> dict[str, Any]:
    tokenizer = engine.model.tokenizer
    finals: list[Finished] = [o.final for o in outcomes]
    for final in finals:
        check_finish(final)
        refusal = output_refusal(grammar, final, grammar_param)
        if refusal is not None:
            raise refusal
    wants_logprobs = body.logprobs_count() is not None
    prefix = _echo_prefix(engine, body)
    choices = []
    for index, outcome in enumerate(outcomes):
        final = outcome.final
        logprobs = (
            fmt.text_logprobs(tokenizer, outcome.events, len(prefix)) if wants_logprobs else None
        )
        choices.append(fmt.text_choice(index, prefix + final.text, final, logprobs))
    whole = {
        **fmt.envelope("text_completion", request_id, created, state.model_name),
        "choices": choices,
        "usage": fmt.usage(finals),
    }
    if body.timings_per_token and len(finals) == 1:  # `llama_timings`
        whole["timings"] = at_end(finals[0])
    return whole


async def _stream(
    state: ServerState,
    engine: Engine,
    handles: list[Any],
    request_id: str,
    created: int,
    include_usage: bool,
    body: CompletionRequest,
    grammar: Grammar | None = None,
    grammar_param: str = SCHEMA_PARAM,
) -> AsyncIterator[str]:
    tokenizer = engine.model.tokenizer
    head = fmt.envelope("text_completion", request_id, created, state.model_name)
    if include_usage:
        head["usage"] = None  # on every chunk but the last, as OpenAI streams
    wants_logprobs = body.logprobs_count() is not None
    finals: list[Finished] = []
    prefix = _echo_prefix(engine, body)
    offsets = [len(prefix)] * len(handles)  # text_offset of each choice's next token
    per_token = bool(body.timings_per_token)
    if prefix:
        for index in range(len(handles)):
            yield fmt.sse({**head, "choices": [_chunk_choice(index, prefix, None, None)]})
    # aclosing: the handles are cancelled as soon as the stream stops, even on an error.
    async with aclosing(merged(handles)) as events:
        try:
            async for index, event in events:
                if isinstance(event, Finished):
                    check_finish(event)  # a cut-short stream ends with an error event instead
                    refusal = output_refusal(grammar, event, grammar_param)
                    if refusal is not None:  # never "stop" on a document the grammar refuses
                        raise refusal
                    finals.append(event)
                    reason = fmt.FINISH_REASONS[event.reason]
                    choice = _chunk_choice(index, "", reason, None)
                    timings = at_end(event) if per_token else None
                elif event.text or (wants_logprobs and event.token_id >= 0):
                    choice = _token_choice(tokenizer, index, event, offsets, wants_logprobs)
                    timings = at_token(handles[index].timings, event) if per_token else None
                else:
                    continue  # a token that completes no character yet
                extra = {"timings": timings} if timings is not None else {}
                yield fmt.sse({**head, "choices": [choice], **extra})
        except APIError as exc:
            yield fmt.sse(error_body(exc.message, exc.kind, exc.param, exc.code))
    if include_usage:
        last: dict[str, Any] = {"usage": fmt.usage(finals)}
        if per_token and len(finals) == 1:
            last["timings"] = at_end(finals[0])
        yield fmt.sse({**head, "choices": [], **last})
    yield fmt.sse("[DONE]")


def _token_choice(
    tokenizer: Any,
    index: int,
    event: TokenEvent,
    offsets: list[int],
    wants_logprobs: bool,
) -> dict[str, Any]:
    """The chunk choice for one token of choice ``index``; advances its text offset."""
    logprobs = None
    if wants_logprobs and event.token_id >= 0:
        logprobs = fmt.text_logprobs(tokenizer, [event], offsets[index])
    offsets[index] += len(event.text)
    return _chunk_choice(index, event.text, None, logprobs)


def _echo_prefix(engine: Engine, body: CompletionRequest) -> str:
    """The prompt text a completion with ``echo`` repeats before its output."""
    if not body.echo:
        return ""
    prompt = body.prompt_input()
    return prompt if isinstance(prompt, str) else engine.model.tokenizer.decode(prompt)


def _chunk_choice(
    index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
