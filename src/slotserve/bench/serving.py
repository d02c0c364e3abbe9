"""Serving scenarios on the engine: ``concurrency``, ``mixed`` and ``bargein``.

Every figure comes from the engine's own per-request timings (`RequestTimings`), so the
benchmark and the server's metrics share one definition.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from rich.progress import Progress

from slotserve.bench.stats import percentile, summary
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.model import Model
from slotserve.sampling import SamplingParams

LEVELS = (1, 2, 4, 8)
DECODE_TOKENS = 32


def _prompt(model: Model, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, model.info.vocab_size) for _ in range(n)]


def _aggregate_decode_tok_s(finals: list[Finished]) -> float:
    """Tokens after each request's first, over the span from the first first-token to the
    last token of any request (all requests decode together in that span)."""
    start = min(f.timings.token_times[0] for f in finals)
    end = max(f.timings.token_times[-1] for f in finals)
    tokens = sum(len(f.timings.token_times) - 1 for f in finals)
    return tokens / (end - start)


def run_concurrency(model: Model, repeats: int = 3) -> dict[str, Any]:
    engine = Engine(
        model,
        EngineConfig(max_seqs=max(LEVELS), max_context=256, kv_layout="cell", max_batch_tokens=512),
    )
    params = SamplingParams(temperature=0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("bench concurrency", total=len(LEVELS) * repeats)
            for level in LEVELS:
                rates, itls = [], []
                for repeat in range(repeats):
                    handles = [
                        engine.submit(_prompt(model, 32, repeat * 100 + i), params)
                        for i in range(level)
                    ]
                    finals = [h.result() for h in handles]
                    rates.append(_aggregate_decode_tok_s(finals))
                    itls += [gap for f in finals for gap in f.timings.itl]
                    progress.advance(task)
                rows.append(
                    {
                        "sessions": level,
                        "aggregate_tok_s": summary(rates),
                        "itl_p50_s": round(percentile(itls, 50), 4),
                        "itl_p99_s": round(percentile(itls, 99), 4),
                    }
                )
    finally:
        engine.close()
    single = rows[0]["aggregate_tok_s"]["median"]
    top = rows[-1]["aggregate_tok_s"]["median"]
    return {
        "decode_tokens": DECODE_TOKENS,
        "repeats": repeats,
        "rows": rows,
        "scaling_8_vs_1": round(top / single, 2),
    }


def _interactive_itl(engine: Engine, model: Model, seed: int) -> float:
    params = SamplingParams(temperature=0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    final = engine.submit(_prompt(model, 24, seed), params, priority="interactive").result()
    return statistics.median(final.timings.itl)


def _mixed_ratio(model: Model, policy: str, repeats: int) -> dict[str, Any]:
    context = min(1536, model.info.max_context)
    background_prompt = min(1024, context // 2)
    background_tokens = min(400, context - background_prompt)
    config = EngineConfig(
        max_seqs=2,
        max_context=context,
        kv_layout="cell",
        policy=policy,
        prefill_chunk=256,
        max_batch_tokens=512,
    )
    engine = Engine(model, config)
    try:
        alone = [_interactive_itl(engine, model, seed) for seed in range(repeats)]
        background_params = SamplingParams(
            max_new_tokens=background_tokens, ignore_eos=True, seed=1
        )
        together = []
        for seed in range(repeats):
            job = engine.submit(
                _prompt(model, background_prompt, 99), background_params, "background"
            )
            time.sleep(0.05)  # the job is admitted and prefilling when the chat turn arrives
            together.append(_interactive_itl(engine, model, seed))
            job.cancel(wait=True)
    finally:
        engine.close()
    alone_p50, together_p50 = statistics.median(alone), statistics.median(together)
    return {
        "itl_p50_alone_s": round(alone_p50, 4),
        "itl_p50_with_background_s": round(together_p50, 4),
        "ratio": round(together_p50 / alone_p50, 3),
    }


def run_mixed(model: Model, repeats: int = 3) -> dict[str, Any]:
    isolate = _mixed_ratio(model, "isolate", repeats)
    fifo = _mixed_ratio(model, "fifo", repeats)
    return {
        "isolate": isolate,
        "fifo": fifo,
        "itl_ratio_isolate": isolate["ratio"],
        "itl_ratio_fifo": fifo["ratio"],
    }


def run_bargein(model: Model, repeats: int = 3, sessions: int = 40) -> dict[str, Any]:
    """Voice-assistant pattern: short sessions, a few live at once, each cancelled after a
    random number of tokens; measures cancel→release and checks nothing leaks."""
    config = EngineConfig(max_seqs=4, max_context=256, kv_layout="cell")
    engine = Engine(model, config)
    rng = random.Random(0)
    latencies: list[float] = []
    began = time.monotonic()
    try:
        live: list[tuple[Any, int]] = []
        params = SamplingParams(temperature=0.7, max_new_tokens=64, ignore_eos=True)
        for i in range(sessions):
            handle = engine.submit(_prompt(model, 16, i), params, priority="interactive")
            live.append((handle, rng.randrange(1, 12)))
            if len(live) == 3 or i == sessions - 1:
                for handle, after in live:
                    for n, _event in enumerate(handle, 1):
                        if n >= after:
                            break
                    ack = handle.cancel(wait=True)
                    assert ack is not None
                    latencies.append(ack.latency_s)
                live = []
        steps = list(engine.counters.step_seconds)
        stats = engine.stats()
    finally:
        engine.close()
    span = time.monotonic() - began
    return {
        "sessions": sessions,
        "sessions_per_s": round(sessions / span, 2),
        "cancel_release_p50_s": round(percentile(latencies, 50), 4),
        "cancel_release_p99_s": round(percentile(latencies, 99), 4),
        "cancel_release_max_s": round(max(latencies), 4),
        "step_p99_s": round(percentile(steps, 99), 4),
        "slots_in_use_end": stats.slots_in_use,
        "kv_blocks_leaked": stats.kv_blocks_used,
    }
