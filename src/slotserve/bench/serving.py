"""Serving scenarios on the engine: ``concurrency``, ``mixed`` and ``bargein``.

Every figure comes from the engine's own per-request timings (`RequestTimings`), so the
benchmark and the server's metrics share one definition.
"""

from __future__ import annotations

import dataclasses
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


def prompt_ids(model: Model, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, model.info.vocab_size) for _ in range(n)]


def aggregate_decode_tok_s(finals: list[Finished]) -> float:
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
                        engine.submit(prompt_ids(model, 32, repeat * 100 + i), params)
                        for i in range(level)
                    ]
                    finals = [h.result() for h in handles]
                    rates.append(aggregate_decode_tok_s(finals))
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


# Background shares the ``mixed`` scenario sweeps (`EngineConfig.background_min_share`).
SHARES = (0.0, 0.05, 0.1, 0.2, 0.3)


def _chat_turn(engine: Engine, model: Model, seed: int) -> Finished:
    params = SamplingParams(temperature=0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    return engine.submit(prompt_ids(model, 24, seed), params, priority="interactive").result()


def _mixed_config(
    model: Model, policy: str, share: float | None, base: EngineConfig | None = None
) -> EngineConfig:
    shared: dict[str, Any] = {} if share is None else {"background_min_share": share}
    if base is not None:  # a preset's shape, with the policy and share under test
        return dataclasses.replace(base, policy=policy, **shared)
    return EngineConfig(
        max_seqs=2,
        max_context=min(1536, model.info.max_context),
        kv_layout="cell",
        policy=policy,
        prefill_chunk=256,
        max_batch_tokens=512,
        **shared,
    )


def _mixed_ratio(
    model: Model,
    policy: str,
    repeats: int,
    share: float | None = None,
    base: EngineConfig | None = None,
) -> dict[str, Any]:
    """A chat turn's ITL alone and beside a long background job (same engine, same run);
    ``share`` sets the background's minimum share (None: the engine default or the
    ``base`` config's)."""
    config = _mixed_config(model, policy, share, base)
    context = config.max_context
    background_prompt = min(1024, context // 2)
    background_tokens = min(400, context - background_prompt)
    engine = Engine(model, config)
    background_params = SamplingParams(max_new_tokens=background_tokens, ignore_eos=True, seed=1)
    alone: list[list[float]] = []
    together: list[list[float]] = []
    progressed: list[int] = []
    try:
        # Alone and beside the job in turns, so that a drift in machine load (other work
        # on the cores) falls on both sides of each ratio.
        for seed in range(repeats):
            alone.append(_chat_turn(engine, model, seed).timings.itl)
            job = engine.submit(
                prompt_ids(model, background_prompt, 99), background_params, "background"
            )
            time.sleep(0.05)  # the job is admitted and prefilling when the chat turn arrives
            turn = _chat_turn(engine, model, seed)
            together.append(turn.timings.itl)
            job.cancel(wait=True)
            progressed.append(_tokens_during(job.result(), turn))
    finally:
        engine.close()
    return _itl_comparison(alone, together, progressed, engine.config.background_min_share)


def _tokens_during(job: Finished, turn: Finished) -> int:
    """Tokens the background job produced while the chat turn ran (its prefill chunks
    do not count: only sampled tokens)."""
    begin, end = turn.timings.submitted, turn.timings.token_times[-1]
    return sum(begin <= t <= end for t in job.timings.token_times)


def _itl_comparison(
    alone: list[list[float]], together: list[list[float]], progressed: list[int], share: float
) -> dict[str, Any]:
    """Per statistic (p50, mean, p90 of a turn's ITL): the median alone, the median beside
    the job, and the median of the per-repeat ratios (each pair measured back to back)."""
    stats: dict[str, Any] = {
        "p50": statistics.median,
        "mean": statistics.fmean,
        "p90": lambda itl: percentile(itl, 90),
    }
    result: dict[str, Any] = {"background_min_share": share}
    for name, stat in stats.items():
        a = [float(stat(itl)) for itl in alone]
        t = [float(stat(itl)) for itl in together]
        result[f"itl_{name}_alone_s"] = round(statistics.median(a), 4)
        result[f"itl_{name}_with_background_s"] = round(statistics.median(t), 4)
        result[f"ratio_{name}"] = round(
            statistics.median([y / x for x, y in zip(a, t, strict=True)]), 3
        )
    result["ratio"] = result["ratio_p50"]  # the figure earlier reports name "ratio"
    result["background_tokens_during_turn"] = int(statistics.median(progressed))
    return result


def run_mixed(
    model: Model,
    repeats: int = 3,
    shares: tuple[float, ...] = SHARES,
    config: EngineConfig | None = None,
) -> dict[str, Any]:
    """A chat turn beside a long background job: ``isolate`` (the default share) against
    ``fifo``, and under ``isolate`` a sweep of the background's minimum share against the
    chat turn's ITL ratio (what not starving background costs). ``config`` (a preset's)
    replaces the scenario's engine shape; the policy and share are still varied."""
    if config is not None and config.max_seqs < 2:
        raise ValueError(
            f"mixed needs max_seqs >= 2 (a chat turn beside a job); the config has "
            f"max_seqs={config.max_seqs}: use a preset with two classes (chat+background)"
        )
    sweep = [_mixed_ratio(model, "isolate", repeats, share, config) for share in shares]
    default = (config or EngineConfig()).background_min_share
    at_default = [point for point in sweep if point["background_min_share"] == default]
    isolate = at_default[0] if at_default else _mixed_ratio(model, "isolate", repeats, None, config)
    fifo = _mixed_ratio(model, "fifo", repeats, None, config)
    return {
        "isolate": isolate,
        "fifo": fifo,
        "itl_ratio_isolate": isolate["ratio"],
        "itl_ratio_fifo": fifo["ratio"],
        "share_sweep": sweep,
    }


def run_bargein(
    model: Model, repeats: int = 3, sessions: int = 40, config: EngineConfig | None = None
) -> dict[str, Any]:
    """Voice-assistant pattern: short sessions, a few live at once, each cancelled after a
    random number of tokens; measures cancel→release and checks nothing leaks. ``config``
    (a preset's) replaces the scenario's engine config."""
    config = config or EngineConfig(max_seqs=4, max_context=256, kv_layout="cell")
    live_at_once = min(3, config.max_seqs)
    engine = Engine(model, config)
    rng = random.Random(0)
    latencies: list[float] = []
    began = time.monotonic()
    try:
        live: list[tuple[Any, int]] = []
        params = SamplingParams(temperature=0.7, max_new_tokens=64, ignore_eos=True)
        for i in range(sessions):
            handle = engine.submit(prompt_ids(model, 16, i), params, priority="interactive")
            live.append((handle, rng.randrange(1, 12)))
            if len(live) == live_at_once or i == sessions - 1:
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
        "kv_blocks_leaked": stats.kv_blocks_held,  # parked KV is reclaimable, not a leak
    }
