"""Scenario ``structured``: what constrained decoding (``response_format`` with a JSON
schema, an llguidance grammar) costs per decode step against free decoding, on the engine,
at batch 1 and batch 8.

Free and constrained batches run back to back in one engine, so a drift in machine load
falls on both sides of each ratio; the ratios are medians over repeats. Both use the
server's default sampling, so the difference is the grammar: its mask per row and the
private copy of the logits the mask is written into.

Then what a compile costs everyone else (issue 30): an interactive request's inter-token
latency alone, and while a slow schema compiles in the compiler's bounded pool (a worker
process at the lowest CPU priority, `GrammarCompiler.submit`), and while it compiles the
old way (a thread of the serving process at normal priority, as ``asyncio.to_thread`` did).

The tool-call case (a request with ``tools`` and ``tool_choice: "required"``, decoded under
the server's call grammar) is `structured_tools`.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import threading
import time
from typing import Any

from rich.progress import Progress

from slotserve.bench.stats import summary
from slotserve.bench.structured_hostile import POOL_PATTERNS, run_hostile_schemas, slow_schema
from slotserve.bench.structured_tools import run_tool_calls
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.model import Model
from slotserve.sampling import Grammar, GrammarCompiler, GrammarError, SamplingParams
from slotserve.sampling.grammar import GrammarConfig

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
# An interactive request decoding while a compile runs: greedy, this many tokens.
ITL_TOKENS = 48
# The slow schema: an allOf of patterns (the probe), exponential in their count.
# The old way, in a thread that cannot be stopped, a schema of this many patterns takes
# seconds (it must outlast the request: see ``overlap``); in the pool, POOL_PATTERNS.
THREAD_PATTERNS = 19
SLOW_CONFIG = GrammarConfig(timeout_s=120.0, max_bytes=2**32, cache_bytes=2**32)
# The target: ITL while a compile runs within this factor of ITL alone.
ITL_TARGET_RATIO = 1.15
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


def _interactive_itl(engine: Engine, model: Model, seed: int) -> float:
    """Median ms between the tokens of one greedy request decoding alone in the engine."""
    params = SamplingParams(temperature=0, max_new_tokens=ITL_TOKENS, ignore_eos=True)
    final = engine.submit(_prompt(model, seed), params).result()
    gaps = [b - a for a, b in itertools.pairwise(final.timings.token_times)]
    return statistics.median(gaps) * 1000


def _compile_in_thread(compiler: GrammarCompiler, schema: dict[str, Any]) -> threading.Thread:
    """The old way: compile in a thread of this process at normal priority."""

    def compile_it() -> None:
        with contextlib.suppress(GrammarError):  # it ends refused: its cost is measured
            compiler.json_schema(schema)

    thread = threading.Thread(target=compile_it, daemon=True)
    thread.start()
    return thread


def run_itl_while_compiling(model: Model, repeats: int = 3) -> dict[str, Any]:
    """An interactive request's ITL alone, while `slow_schema` compiles in the bounded
    pool, and while it compiles the old way; ratios to alone per repeat (each triple run
    back to back), median (min-max). ``overlap``: the share of repeats whose compile was
    still running when the request ended (a ratio only means something when it was)."""
    config = EngineConfig(
        max_seqs=2, max_context=min(256, model.info.max_context), kv_layout="cell"
    )
    engine = Engine(model, config)
    compiler = GrammarCompiler(model.tokenizer, model.info.vocab_size, SLOW_CONFIG)
    alone: list[float] = []
    pooled: list[float] = []
    threaded: list[float] = []
    overlap = {"pool": 0, "thread": 0}
    try:
        compiler.submit({"type": "integer"}).result()  # the worker and index, started
        compiler.json_schema({"type": "integer"})
        _interactive_itl(engine, model, 0)  # warm-up, not counted
        for repeat in range(1, repeats + 1):
            alone.append(_interactive_itl(engine, model, repeat))
            job = compiler.submit(slow_schema(repeat, POOL_PATTERNS))
            while not job.future.running():
                time.sleep(0.01)
            time.sleep(0.2)  # the worker is compiling
            pooled.append(_interactive_itl(engine, model, repeat))
            overlap["pool"] += not job.future.done()
            job.cancel()
            thread = _compile_in_thread(compiler, slow_schema(repeat, THREAD_PATTERNS))
            time.sleep(0.2)
            threaded.append(_interactive_itl(engine, model, repeat))
            overlap["thread"] += thread.is_alive()
            thread.join()
    finally:
        compiler.close()
        engine.close()
    pool_ratios = [p / a for p, a in zip(pooled, alone, strict=True)]
    thread_ratios = [t / a for t, a in zip(threaded, alone, strict=True)]
    ratio = statistics.median(pool_ratios)
    return {
        "itl_tokens": ITL_TOKENS,
        "slow_schema_patterns": {"pool": POOL_PATTERNS, "thread": THREAD_PATTERNS},
        "itl_ms_alone": summary(alone),
        "itl_ms_compiling_pool": summary(pooled),
        "itl_ms_compiling_thread": summary(threaded),
        "itl_ratio_pool": summary(pool_ratios),
        "itl_ratio_thread": summary(thread_ratios),
        "overlap_pool": overlap["pool"] / repeats,
        "overlap_thread": overlap["thread"] / repeats,
        "itl_target_ratio": ITL_TARGET_RATIO,
        "itl_ratio_pool_over_target": round(max(ratio - ITL_TARGET_RATIO, 0.0), 3),
    }


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
    with Progress(transient=True) as progress:
        # The json_schema case's batches, then the tool-call case's.
        task = progress.add_task("bench structured", total=2 * len(BATCHES) * (repeats + 1))
        try:
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
        progress.update(task, description="bench structured: tool calls")
        tool_calls = run_tool_calls(model, SAMPLING, repeats, lambda: progress.advance(task))
    return {
        "decode_tokens": DECODE_TOKENS,
        "repeats": repeats,
        "sampling": SAMPLING,
        "schema": SCHEMA,
        "grammar_first_compile_s": round(first_compile_s, 4),
        "grammar_compile_s": round(compile_s, 4),
        "rows": rows,
        **{f"step_ratio_batch_{row['batch']}": row["step_ratio"]["median"] for row in rows},
        "tool_calls": tool_calls,
        "itl_while_compiling": run_itl_while_compiling(model, repeats),
        "hostile_schemas": run_hostile_schemas(model, repeats),
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
