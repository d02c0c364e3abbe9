"""Scenario ``structured``: what constrained decoding (``response_format`` with a JSON
schema, an llguidance grammar) costs per decode step against free decoding, on the engine,
at batch 1 and batch 8.

Free and constrained batches run back to back in one engine, so a drift in machine load
falls on both sides of each ratio; the ratios are medians over repeats. Both use the
server's default sampling, so the difference is the grammar: its mask per row and the
private copy of the logits the mask is written into.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.model import Model
from slotserve.sampling import Grammar, GrammarCompiler, SamplingParams

BATCHES = (1, 8)
DECODE_TOKENS = 32
PROMPT_TOKENS = 24
# An array of small records, as a tool call or an extraction returns. Every item takes at
# least one token, so with DECODE_TOKENS items the document cannot end (and the grammar
# cannot stop a request) before the free requests' token count.
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": DECODE_TOKENS,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "x": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "x"],
        "additionalProperties": False,
    },
}
# The server's defaults when neither the request nor generation_config.json says otherwise.
SAMPLING: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _prompt(model: Model, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, model.info.vocab_size) for _ in range(PROMPT_TOKENS)]


def _params(seed: int, grammar: Grammar | None) -> SamplingParams:
    """Seeded default sampling; a free request ignores EOS so it decodes every token, a
    constrained one cannot meet EOS before its document is complete (see SCHEMA)."""
    return SamplingParams(
        **SAMPLING,
        seed=seed,
        max_new_tokens=DECODE_TOKENS,
        ignore_eos=grammar is None,
        grammar=grammar,
    )


def _together_gaps(finals: list[Finished]) -> list[float]:
    """Gaps between tokens while every request of the batch decodes (from the last first
    token to the first last token): each gap is one decode step of the whole batch."""
    start = max(f.timings.token_times[0] for f in finals)
    end = min(f.timings.token_times[-1] for f in finals)
    return [
        b - a
        for f in finals
        for a, b in itertools.pairwise(f.timings.token_times)
        if start <= a and b <= end
    ]


def _run_batch(
    engine: Engine, model: Model, size: int, seed: int, grammar: Grammar | None
) -> tuple[float, float]:
    """(median decode step ms, sampling ms per token) of ``size`` requests submitted together."""
    handles = [
        engine.submit(_prompt(model, seed * 100 + i), _params(seed * 100 + i, grammar))
        for i in range(size)
    ]
    finals = [handle.result() for handle in handles]
    short = [len(f.tokens) for f in finals if len(f.tokens) < DECODE_TOKENS]
    if short:
        raise RuntimeError(
            f"structured: a request ended after {short[0]} of {DECODE_TOKENS} tokens "
            f"({finals[0].reason}); the comparison needs every request to decode them all"
        )
    step_ms = statistics.median(_together_gaps(finals)) * 1000
    sampling_ms = sum(f.timings.sampling_time for f in finals) * 1000 / (size * DECODE_TOKENS)
    return step_ms, sampling_ms


def _compile(model: Model) -> tuple[Grammar, float, float]:
    """The schema's grammar, and the seconds of its first compile (with the tokenizer's
    index) and of a second one (the index reused, as a server's compiler does)."""
    compiler = GrammarCompiler(model.tokenizer, model.info.vocab_size)
    start = time.perf_counter()
    compiler.json_schema(SCHEMA)
    first = time.perf_counter() - start
    start = time.perf_counter()
    grammar = compiler.json_schema(SCHEMA)
    again = time.perf_counter() - start
    return grammar, first, again


def run_structured(model: Model, repeats: int = 3) -> dict[str, Any]:
    """Decode step time, free and constrained, at each of BATCHES; ratio constrained ÷ free
    per repeat (the pair run back to back), median (min–max) over repeats."""
    grammar, first_compile_s, compile_s = _compile(model)
    config = EngineConfig(
        max_seqs=max(BATCHES),
        max_context=min(256, model.info.max_context),
        kv_layout="cell",
        max_batch_tokens=max(512, max(BATCHES) * PROMPT_TOKENS),
    )
    engine = Engine(model, config)
    rows: list[dict[str, Any]] = []
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("bench structured", total=len(BATCHES) * (repeats + 1))
            for size in BATCHES:
                _run_batch(engine, model, size, 0, None)  # warm-up, not counted
                _run_batch(engine, model, size, 0, grammar)
                progress.advance(task)
                free, constrained = [], []
                for repeat in range(1, repeats + 1):
                    free.append(_run_batch(engine, model, size, repeat, None))
                    constrained.append(_run_batch(engine, model, size, repeat, grammar))
                    progress.advance(task)
                rows.append(_row(size, free, constrained))
    finally:
        engine.close()
    return {
        "decode_tokens": DECODE_TOKENS,
        "repeats": repeats,
        "sampling": SAMPLING,
        "schema": SCHEMA,
        "grammar_first_compile_s": round(first_compile_s, 4),
        "grammar_compile_s": round(compile_s, 4),
        "rows": rows,
        **{f"step_ratio_batch_{row['batch']}": row["step_ratio"]["median"] for row in rows},
    }


def _row(
    size: int, free: list[tuple[float, float]], constrained: list[tuple[float, float]]
) -> dict[str, Any]:
    pairs = list(zip(free, constrained, strict=True))
    return {
        "batch": size,
        "step_ms_free": summary([f[0] for f in free]),
        "step_ms_constrained": summary([c[0] for c in constrained]),
        "step_ratio": summary([c[0] / f[0] for f, c in pairs]),
        "grammar_ms_per_step": summary([c[0] - f[0] for f, c in pairs]),
        "sampling_ms_per_token_free": summary([f[1] for f in free]),
        "sampling_ms_per_token_constrained": summary([c[1] for c in constrained]),
    }
