"""Speculation changes nothing but the number of steps: over random prompts (repetitive
ones, so that drafts are made and both accepted and rejected), sampling settings, seeds,
stop strings and lengths, a request's tokens and their log-probabilities (with the top 3)
are equal, bit for bit, with ``speculate="ngram"`` and ``"off"``; on the bundled model's
blocks and on Gemma 3 (sliding-window layers), on flat, cell and ring, with the prefix
cache on and off, alone or beside another request. Each engine's pool keeps its
invariants throughout and is back at its baseline when closed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.speculate import StepCost

LAYOUTS: dict[str, dict[str, Any]] = {
    "flat": {"kv_layout": "flat"},
    "cell": {"kv_layout": "cell", "block_size": 16},
    "ring": {"kv_layout": "ring", "ring_window": 16, "sinks": 2},  # wraps mid-answer
}
WORDS = ["the", "red", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "sleeps", "{"]
Trace = list[tuple[int, float | None, tuple[tuple[int, float], ...]]]


@dataclass(frozen=True)
class Case:
    prompt: str
    params: ss.SamplingParams
    beside: str | None  # a second request's prompt, submitted at the same time


@st.composite
def cases(draw: st.DrawFn) -> Case:
    sentence = " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=3, max_size=10)))
    prompt = f"Copy this text exactly: {sentence}. {sentence}. {sentence}."
    sampled = draw(st.booleans())
    stop = draw(st.sampled_from([(), (), (".",), (" dog",)]))
    params = ss.SamplingParams(
        temperature=draw(st.sampled_from([0.6, 1.0])) if sampled else 0.0,
        top_k=draw(st.sampled_from([0, 40])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.15])),
        seed=draw(st.integers(0, 2**31)),
        max_new_tokens=draw(st.integers(1, 28)),
        ignore_eos=draw(st.booleans()),
        stop=stop,
        logprobs=3,
    )
    beside = draw(st.none() | st.just(f"Say it twice: {sentence}, {sentence}"))
    return Case(prompt, params, beside)


COPYING = Case(  # a greedy count both models continue: the drafts are the answer
    prompt="1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
    params=ss.SamplingParams(temperature=0.0, max_new_tokens=28, ignore_eos=True, logprobs=3),
    beside=None,
)


def trace(handle: ss.RequestHandle) -> Trace:
    return [
        (e.token_id, e.logprob, e.top_logprobs)
        for e in handle
        if isinstance(e, ss.TokenEvent) and e.token_id >= 0
    ]


def run(engine: ss.Engine, case: Case) -> tuple[Trace, Trace | None, str]:
    handle = engine.submit(case.prompt, case.params)
    beside = None if case.beside is None else engine.submit(case.beside, case.params)
    mine = trace(handle)
    text = handle.result().text
    other = None if beside is None else trace(beside)
    engine.check_integrity()
    return mine, other, text


@pytest.fixture(scope="module")
def blocks(bundled_blocks: ss.Model) -> ss.Model:
    return bundled_blocks


class CheapRows(StepCost):
    """A step cost under which extra rows are nearly free, whatever this machine's load:
    the engine then drafts wherever a proposal exists, so the property is tested on many
    drafts (accepted and rejected) rather than on what the measured cost allowed."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def line(self) -> tuple[float, float]:
        return 1.0, 0.001


def speculating(model: ss.Model, config: ss.EngineConfig) -> ss.Engine:
    """An engine with ``config`` (speculate="ngram") that drafts wherever it can."""
    engine = ss.Engine(model, config)
    speculator = engine._stepper.speculator  # the test fixes the cost model, nothing else
    assert speculator is not None
    speculator.cost = CheapRows()
    return engine


def check_equal_output(model: ss.Model, config: dict[str, Any], examples: int) -> None:
    on = speculating(model, ss.EngineConfig(speculate="ngram", **config))
    off = ss.Engine(model, ss.EngineConfig(speculate="off", **config))

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    @example(case=COPYING)  # whatever the random cases draw, some drafts are accepted
    def equal(case: Case) -> None:
        assert run(on, case) == run(off, case)

    try:
        equal()
        stats = on.stats().speculation
        assert stats is not None and off.stats().speculation is None
        assert stats.drafted == stats.accepted + stats.rejected
        assert stats.accepted > 0  # the property was tested on accepted drafts
    finally:
        for engine in (on, off):
            engine.close()
            engine.check_integrity()
            assert engine.stats().slots_in_use == 0


@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bundled_output_is_the_same_with_and_without_speculation(
    blocks: ss.Model, layout: str, prefix: bool
) -> None:
    config = {
        **LAYOUTS[layout],
        "max_seqs": 2,
        "max_context": 160,
        "policy": "fifo",
        "prefix_cache_bytes": "8MiB" if prefix else 0,
    }
    check_equal_output(blocks, config, examples=8)


@pytest.fixture(scope="module")
def gemma(gemma3: ss.Model) -> Iterator[ss.Model]:
    yield gemma3


@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma3_output_is_the_same_with_and_without_speculation(
    gemma: ss.Model, layout: str, prefix: bool
) -> None:
    config = {
        **LAYOUTS[layout],
        "max_seqs": 2,
        "max_context": 160,
        "policy": "fifo",
        "prefix_cache_bytes": "16MiB" if prefix else 0,
    }
    check_equal_output(gemma, config, examples=4)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "colour": {"type": "string"}},
    "required": ["name", "colour"],
}
STATEFUL: dict[str, dict[str, Any]] = {
    "dry": {"temperature": 0.8, "dry_multiplier": 0.8, "dry_allowed_length": 2},
    "mirostat-1": {"temperature": 0.9, "mirostat": 1},
    "mirostat-2": {"temperature": 0.9, "mirostat": 2},
    "xtc-typical": {"temperature": 0.9, "xtc_probability": 0.5, "typical_p": 0.9},
    "penalties": {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    "min-tokens": {"temperature": 0.0, "min_tokens": 12, "min_tokens_ids": (2,)},
    "logit-bias": {"temperature": 0.0, "logit_bias": ((28, 5.0), (30, -100.0))},
    "grammar": {"temperature": 0.7, "grammar": "schema"},
}


@pytest.mark.parametrize("sampler", STATEFUL)
def test_stateful_samplers_give_the_same_output(blocks: ss.Model, sampler: str) -> None:
    """Samplers with state of their own (DRY's history, mirostat's mu, XTC's draws, the
    penalties' counts, min_tokens' count, a grammar's matcher) advance exactly as without
    speculation: each drafted position is sampled only once its predecessors were
    accepted."""
    extra = dict(STATEFUL[sampler])
    if extra.get("grammar") == "schema":
        compiler = ss.sampling.GrammarCompiler(blocks.tokenizer, blocks.info.vocab_size)
        extra["grammar"] = compiler.compile_source("schema", json.dumps(SCHEMA), "test")
    params = ss.SamplingParams(seed=11, max_new_tokens=40, logprobs=2, **extra)
    prompt = 'Repeat this JSON: {"name": "fox", "colour": "red"} {"name": "fox", "colour": "red"}'
    config = ss.EngineConfig(max_seqs=1, max_context=160, kv_layout="cell")
    traces, texts = [], []
    for mode in ("ngram", "off"):
        made = replace(config, speculate=mode)
        with speculating(blocks, made) if mode == "ngram" else ss.Engine(blocks, made) as engine:
            handle = engine.submit(prompt, params)
            traces.append(trace(handle))
            texts.append(handle.result().text)
            stats = engine.stats().speculation
            timings = handle.result().timings
            if mode == "ngram":
                assert stats is not None and stats.drafted > 0, "nothing was drafted"
                # One request: its own counts are the engine's.
                assert (timings.drafted_tokens, timings.accepted_tokens) == (
                    stats.drafted,
                    stats.accepted,
                )
            else:
                assert timings.drafted_tokens == timings.accepted_tokens == 0
            engine.close()
            engine.check_integrity()
    assert traces[0] == traces[1] and texts[0] == texts[1]
