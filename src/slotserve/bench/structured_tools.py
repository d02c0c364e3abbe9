"""Scenario ``structured``, its tool-call case: what decoding under the tool-call grammar
costs per decode step against free text, on the engine, at batch 1 and batch 8.

The request is what an on-device assistant sends: three functions (`TOOLS`) and
``tool_choice: "required"``, one call a reply (``parallel_tool_calls: false``). Its tool
plan, prompt and grammar come from the server's own code (`tools.plan_tools`, the rendering
of `completions.chat_tokens`, `tools.tool_grammar` through a `GrammarCache`), so the call
syntax measured is the one the server decodes under for this model's chat template; each
reply is read back with the server's reader (`chat.reply.read_reply`) and every call it
holds is reported (``calls``: name and arguments; the tests validate them against their
function's schema). Every request has the same prompt, computed once and then restored
from the prefix cache: only decoding is timed.

Each request's first `STEP_TOKENS` tokens are timed: free requests (the same prompt, no
grammar, through end-of-sequence) decode exactly that many, constrained ones go on to the
end of their call (so it can be read back). Step times are the gaps between those tokens
while every request of the batch decodes; per repeat their median and p99, and the ratio
constrained ÷ free of each, the pair run back to back; median (min–max) over repeats.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from slotserve.bench.stats import format_summary, markdown_table, percentile, summary
from slotserve.engine import Engine, EngineConfig, Finished, TokenEvent
from slotserve.model import Model
from slotserve.sampling import Grammar, SamplingParams
from slotserve.server.chat.reply import ReplyShape, read_reply
from slotserve.server.chat.structured import GrammarCache
from slotserve.server.chat.tools import ToolPlan, plan_tools, template_input, tool_grammar
from slotserve.server.openai.schemas import ChatCompletionRequest

BATCHES = (1, 8)
# Tokens timed per request. Below the shortest call the tool set allows (about 30 tokens
# for SmolLM2's tokenizer, more for a byte-level one), so the batch stays whole while they
# decode; a call that ends sooner is an error (see `_run_batch`).
STEP_TOKENS = 24
# Room for the longest call: its strings are bounded (maxLength), but a character may take
# up to six bytes (a \uXXXX escape), one token each for a byte-level tokenizer.
CALL_MAX_TOKENS = 768
PREFIX_CACHE_BYTES = "64MiB"


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: list[dict[str, Any]] = [
    _function(
        "set_timer",
        "Start a countdown timer.",
        {
            "minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
            "label": {"type": "string", "maxLength": 40},
        },
    ),
    _function(
        "search_notes",
        "Search the user's notes.",
        {
            "query": {"type": "string", "minLength": 1, "maxLength": 80},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20},
        },
    ),
    _function(
        "read_calendar",
        "Read the user's calendar for one day.",
        {"date": {"type": "string", "format": "date"}},
    ),
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant on the user's phone."},
    {"role": "user", "content": "Remind me to take the bread out of the oven in 25 minutes."},
]


def tool_request() -> ChatCompletionRequest:
    """The chat request of the case, as a client sends it."""
    return ChatCompletionRequest.model_validate(
        {
            "model": "bench",
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )


def _run_batch(
    engine: Engine,
    prompt: list[int],
    size: int,
    seed: int,
    grammar: Grammar | None,
    sampling: dict[str, Any],
    whole: bool = True,
) -> tuple[list[float], list[list[TokenEvent]]]:
    """Step gaps (s) over each request's first STEP_TOKENS tokens while the whole batch
    decodes, and each reply's token events: constrained ones decode to the end of their
    call when ``whole`` (else, as free ones, STEP_TOKENS tokens: a warm-up)."""
    params = [
        SamplingParams(
            **sampling,
            seed=seed * 100 + i,
            max_new_tokens=CALL_MAX_TOKENS if grammar is not None and whole else STEP_TOKENS,
            ignore_eos=grammar is None,
            grammar=grammar,
        )
        for i in range(size)
    ]
    handles = [engine.submit(prompt, p) for p in params]
    replies: list[list[TokenEvent]] = []
    finals: list[Finished] = []
    for handle in handles:
        events = list(handle)
        final = events[-1]
        assert isinstance(final, Finished)
        finals.append(final)
        replies.append([e for e in events if isinstance(e, TokenEvent)])
    for final in finals:
        if final.error is not None or len(final.tokens) < STEP_TOKENS:
            raise RuntimeError(
                f"structured tools: a request ended after {len(final.tokens)} tokens "
                f"({final.reason}{': ' + final.error if final.error else ''}); the case "
                f"times the first STEP_TOKENS={STEP_TOKENS} of every request, so each must "
                "decode more: lower STEP_TOKENS below the shortest call"
            )
    times = [f.timings.token_times[:STEP_TOKENS] for f in finals]
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    gaps = [b - a for t in times for a, b in itertools.pairwise(t) if start <= a and b <= end]
    return gaps, replies


def _read_calls(shape: ReplyShape, replies: list[list[TokenEvent]]) -> list[dict[str, Any]]:
    """Each reply's calls as the server reads them back (`chat.reply.read_reply`): the
    function's name and its arguments, parsed; none for a reply that holds no whole call."""
    calls = []
    for events in replies:
        reply = read_reply(shape, events)
        if reply.cut:  # a call max_tokens cut short: its arguments are not whole
            continue
        for name, arguments in reply.calls:
            calls.append({"name": name, "arguments": json.loads(arguments)})
    return calls


def tool_prompt(model: Model, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    """``body``'s prompt as the server renders it (`completions.chat_tokens`, which reads
    only the engine's tokenizer: the conversation and tools through `tools.template_input`
    and the chat template)."""
    rendered = template_input(model.tokenizer, body.messages, plan)
    return model.tokenizer.encode_chat(
        rendered.messages, add_generation_prompt=True, tools=rendered.tools
    )


def run_tool_calls(
    model: Model,
    sampling: dict[str, Any],
    repeats: int = 3,
    advance: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """The tool-call case (see the module's docstring) with ``sampling`` (`SamplingParams`
    fields); ``advance`` is called after each batch size's warm-up and each repeat."""
    tokenizer = model.tokenizer
    body = tool_request()
    plan = plan_tools(tokenizer, body)
    assert plan is not None  # tools, and a required choice
    shape = ReplyShape(plan.syntax, None, plan.markers(tokenizer))
    prompt = tool_prompt(model, body, plan)
    block = EngineConfig.block_size
    max_context = -(-(len(prompt) + CALL_MAX_TOKENS) // block) * block  # whole KV blocks
    if max_context > model.info.max_context:
        return {
            "skipped": f"its prompt ({len(prompt)} tokens) + CALL_MAX_TOKENS={CALL_MAX_TOKENS} "
            f"exceeds the model's max_context={model.info.max_context}"
        }
    grammars = GrammarCache(model)
    try:
        start = time.perf_counter()
        grammar = asyncio.run(tool_grammar(grammars, plan, tokenizer))
        compile_s = time.perf_counter() - start
    finally:
        grammars.close()
    config = EngineConfig(
        max_seqs=max(BATCHES),
        max_context=max_context,
        kv_layout="cell",
        max_batch_tokens=max(BATCHES) * len(prompt),
        # The one prompt: computed in the first warm-up, restored after.
        prefix_cache_bytes=PREFIX_CACHE_BYTES,
    )
    engine = Engine(model, config)
    rows: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    replies_timed = 0
    try:
        for size in BATCHES:
            _run_batch(engine, prompt, size, 0, None, sampling)  # warm-up, not counted
            _run_batch(engine, prompt, size, 0, grammar, sampling, whole=False)
            advance()
            free, constrained = [], []
            for repeat in range(1, repeats + 1):
                free.append(_run_batch(engine, prompt, size, repeat, None, sampling)[0])
                gaps, replies = _run_batch(engine, prompt, size, repeat, grammar, sampling)
                constrained.append(gaps)
                calls += _read_calls(shape, replies)
                replies_timed += len(replies)
                advance()
            rows.append(_row(size, free, constrained))
    finally:
        engine.close()
    return {
        "tools": [tool["function"]["name"] for tool in TOOLS],
        "tool_choice": "required",
        "syntax": plan.syntax.name,
        "prompt_tokens": len(prompt),
        "step_tokens": STEP_TOKENS,
        "repeats": repeats,
        "grammar_compile_s": round(compile_s, 4),
        "replies": replies_timed,
        "calls": calls,
        "rows": rows,
        **{f"step_ratio_batch_{row['batch']}": row["step_ratio"]["median"] for row in rows},
    }


def _row(size: int, free: list[list[float]], constrained: list[list[float]]) -> dict[str, Any]:
    def ms(gaps: list[float], q: float) -> float:
        return (statistics.median(gaps) if q == 50 else percentile(gaps, q)) * 1000

    pairs = list(zip(free, constrained, strict=True))
    return {
        "batch": size,
        "step_ms_free": summary([ms(f, 50) for f in free]),
        "step_ms_tools": summary([ms(c, 50) for c in constrained]),
        "step_p99_ms_free": summary([ms(f, 99) for f in free]),
        "step_p99_ms_tools": summary([ms(c, 99) for c in constrained]),
        "step_ratio": summary([ms(c, 50) / ms(f, 50) for f, c in pairs]),
        "step_p99_ratio": summary([ms(c, 99) / ms(f, 99) for f, c in pairs]),
    }


def tool_calls_section(r: dict[str, Any]) -> list[str]:
    """The markdown of `run_tool_calls`'s figures (a part of the structured section)."""
    heading = "### structured: tool calls (the call grammar) vs free text, per decode step"
    if "skipped" in r:
        return [heading, "", f"Skipped: {r['skipped']}.", ""]
    lines = [
        heading,
        "",
        f"A chat request with {len(r['tools'])} tools ({', '.join(r['tools'])}) and "
        f'`tool_choice: "{r["tool_choice"]}"`, one call a reply, rendered and constrained '
        f"as the server does ({r['syntax']} call syntax, a {r['prompt_tokens']}-token "
        f"prompt; the grammar compiled in {r['grammar_compile_s'] * 1000:.0f} ms). Each "
        f"request's first {r['step_tokens']} tokens are timed: free ones (the same prompt, "
        "no grammar) decode that many, constrained ones go on to the end of their call. Step "
        "time is the gap between tokens while every request of the batch decodes, its median "
        "and p99 per repeat; ratios are call grammar ÷ free, the pair run back to back, over "
        f"{r['repeats']} repeats. Replies read back as one whole call by the server's reader: "
        f"{len(r['calls'])} of {r['replies']}.",
        "",
    ]
    rows = [
        [
            str(x["batch"]),
            format_summary(x["step_ms_free"]),
            format_summary(x["step_ms_tools"]),
            f"**{format_summary(x['step_ratio'], 2)}**",
            format_summary(x["step_p99_ms_free"]),
            format_summary(x["step_p99_ms_tools"]),
            format_summary(x["step_p99_ratio"], 2),
        ]
        for x in r["rows"]
    ]
    header = [
        "batch",
        "free step ms",
        "call grammar step ms",
        "ratio",
        "free p99 ms",
        "call grammar p99 ms",
        "p99 ratio",
    ]
    return lines + markdown_table(header, rows)
