"""Scenario ``prefix``: what the prefix cache saves, measured honestly.

Shared system prompt: the same ~1,000-token system prompt with 8 different short questions,
one after another, on an engine with the cache off and then on (a fresh engine for each,
back to back in every repeat). Reported: TTFT p50 of each and the ratio off ÷ on per repeat,
prompt tokens computed and restored, and prefill throughput over computed tokens only, its
span including the restoration (the figure a cache could flatter by counting restored
tokens).

Multi-turn chat: a `TextLLMRunner` conversation of 4 turns (those that fit a small
model's context) after the same system prompt,
cache on and off: the prompt tokens each turn computed, which stay flat with the cache and
grow with the conversation without it, and each turn's TTFT.

The disk tier (`slotserve.bench.prefix_store`): restart TTFT with the prefix store on and
off, and step times while a storm of distinct prompts is written, store on and off.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from rich.progress import Progress

from slotserve.bench.prefix_store import run_prefix_store
from slotserve.bench.stats import summary
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.model import Model
from slotserve.runner import GenerationConfig, TextLLMRunner, common_prefix
from slotserve.sampling import SamplingParams

SYSTEM_TOKENS = 1000
NEW_TOKENS = 8
CHAT_NEW_TOKENS = 16
BLOCK_SIZE = 16
SYSTEM_TEXT = (
    "You are the support assistant of a company that makes small weather stations. "
    "Answer in plain English, briefly and precisely. The stations measure temperature, "
    "humidity, pressure, wind speed and rainfall every minute, keep a week of readings, "
    "and send them over Wi-Fi to a phone app. Batteries last about a year; the solar "
    "panel keeps them charged in most climates. Never invent a feature. "
)
QUESTIONS = (
    "How long do the batteries last?",
    "Can it measure snow?",
    "What does the app show?",
    "How often does it take a reading?",
    "Does it work without Wi-Fi?",
    "Is the solar panel enough in winter?",
    "How many days of data does it keep?",
    "Can I export the readings?",
)
CHAT_TURNS = (
    "Hello! What can the station measure?",
    "And how often?",
    "Where does the data go?",
    "Thanks. How do I charge it?",
)


def system_prompt(model: Model, n_tokens: int) -> list[int]:
    """``n_tokens`` tokens of the system text (repeated as needed)."""
    tokens: list[int] = []
    piece = model.tokenizer.encode(SYSTEM_TEXT, add_bos=False)
    while len(tokens) < n_tokens:
        tokens.extend(piece)
    return tokens[:n_tokens]


def _context(model: Model, system: int) -> int:
    """A cell-layout context (multiple of the block size) that holds the system prompt,
    a question and the reply, or the whole chat."""
    want = system + 64 * (len(CHAT_TURNS) + 1)
    context = min(model.info.max_context, -(-want // BLOCK_SIZE) * BLOCK_SIZE)
    return context // BLOCK_SIZE * BLOCK_SIZE


def _engine(model: Model, context: int, cache: bool) -> Engine:
    config = EngineConfig(max_seqs=1, max_context=context, kv_layout="cell", block_size=BLOCK_SIZE)
    if cache:
        pool_bytes = config.kv_bytes(model.info)
        config = dataclasses.replace(config, prefix_cache_bytes=pool_bytes)
    return Engine(model, config)


def _ask_all(engine: Engine, prompts: list[list[int]]) -> list[Finished]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [engine.submit(prompt, params).result() for prompt in prompts]


def _side(finals: list[Finished]) -> dict[str, Any]:
    """TTFT p50 and the prefill accounting of one engine's 8 questions."""
    ttfts = [f.timings.ttft for f in finals]
    computed = sum(f.timings.prompt_tokens_computed for f in finals)
    restored = sum(f.timings.prompt_tokens_restored for f in finals)
    span = sum(f.timings.prefill_time or 0.0 for f in finals)
    return {
        "ttft_p50_s": statistics.median(t for t in ttfts if t is not None),
        "prompt_tokens_computed": computed,
        "prompt_tokens_restored": restored,
        "restore_time_s": sum(f.timings.restore_time for f in finals),
        "prefill_time_s": span,
        "prefill_tok_s": computed / span if span else 0.0,
    }


def _shared_prompt_repeat(
    model: Model, prompts: list[list[int]], context: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One repeat: the questions on a fresh engine without the cache, then with it."""
    sides = []
    for cache in (False, True):
        engine = _engine(model, context, cache)
        try:
            sides.append(_side(_ask_all(engine, prompts)))
        finally:
            engine.close()
    return sides[0], sides[1]


def _chat(model: Model, system_text: str, context: int, cache: bool) -> list[dict[str, Any]]:
    """The 4-turn conversation through the runner; per turn what it computed and TTFT."""
    runner = TextLLMRunner(model, max_context=context, prefix_cache=cache)
    config = GenerationConfig(
        echo=False, temperature=0, max_new_tokens=CHAT_NEW_TOKENS, ignore_eos=True
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": system_text}]
    held: list[int] = []
    turns = []
    try:
        for line in CHAT_TURNS:
            messages.append({"role": "user", "content": line})
            tokens = _chat_tokens(model, messages)
            if len(tokens) + CHAT_NEW_TOKENS >= context:
                break  # a small model's context: report the turns that fit
            keep = common_prefix(held, tokens, runner.position)
            result = runner.generate_from_pos(tokens[keep:], keep, config)
            stats = result.stats
            turns.append(
                {
                    "conversation_tokens": len(tokens),
                    "prompt_tokens_computed": stats.prompt_tokens_computed,
                    "prompt_tokens_restored": stats.prompt_tokens_restored,
                    "ttft_s": (stats.first_token_ms - stats.inference_start_ms) / 1000,
                }
            )
            messages.append({"role": "assistant", "content": result.text})
            held = tokens + result.tokens
    finally:
        runner.close()
    return turns


def _chat_tokens(model: Model, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = model.tokenizer
    if tokenizer.chat_template:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("\n".join(m["content"] for m in messages), add_bos=False)


def run_prefix(model: Model, repeats: int = 3) -> dict[str, Any]:
    """Shared system prompt (cache off vs on, per repeat), multi-turn chat, and the disk
    tier (store on vs off: restart TTFT, step times under writes)."""
    n_system = min(SYSTEM_TOKENS, model.info.max_context // 8)
    system = system_prompt(model, n_system)
    tokenizer = model.tokenizer
    prompts = [system + tokenizer.encode(" " + q, add_bos=False) for q in QUESTIONS]
    context = _context(model, n_system)
    offs, ons, ratios = [], [], []
    with Progress(transient=True) as progress:
        task = progress.add_task("bench prefix", total=repeats + 3)
        _shared_prompt_repeat(model, prompts[:2], context)  # warm-up, not counted
        progress.advance(task)
        for _ in range(repeats):
            off, on = _shared_prompt_repeat(model, prompts, context)
            offs.append(off)
            ons.append(on)
            ratios.append(off["ttft_p50_s"] / on["ttft_p50_s"])
            progress.advance(task)
        system_text = tokenizer.decode(system)
        chat = {
            "off": _chat(model, system_text, context, cache=False),
            "on": _chat(model, system_text, context, cache=True),
        }
        progress.advance(task)
        store = run_prefix_store(model, system, repeats, warm_up=repeats > 1)  # 1: a smoke run
        progress.advance(task)
    return {
        "system_tokens": n_system,
        "questions": len(prompts),
        "new_tokens": NEW_TOKENS,
        "repeats": repeats,
        "context": context,
        "ttft_p50_s_off": summary([s["ttft_p50_s"] for s in offs]),
        "ttft_p50_s_on": summary([s["ttft_p50_s"] for s in ons]),
        "ttft_ratio": summary(ratios),
        "prefill_tok_s_off": summary([s["prefill_tok_s"] for s in offs]),
        "prefill_tok_s_on": summary([s["prefill_tok_s"] for s in ons]),
        "off": offs[-1],
        "on": ons[-1],
        "chat_new_tokens": CHAT_NEW_TOKENS,
        "chat": chat,
        "ttft_ratio_p50": summary(ratios)["median"],
        "store": store,
    }
