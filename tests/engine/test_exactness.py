"""Exactness in the engine, on the bundled model's GGUF blocks (the default weights): the
same request gives the same tokens and the same log-probabilities, bit for bit, whether it
runs alone or beside other requests of every class, however its prompt is chunked, and
whether its prefix was restored from the prefix cache; a seed gives the same text."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import slotserve as ss

PROMPTS = ["The moon is", "Water boils at", "My favourite colour is", "Paris is the capital of"]
LAYOUTS: dict[str, dict[str, Any]] = {
    "flat": {"kv_layout": "flat"},
    "cell": {"kv_layout": "cell", "block_size": 16},
    "ring": {"kv_layout": "ring", "ring_window": 12, "sinks": 2},  # wraps mid-answer
}
Trace = list[tuple[int, float | None, tuple[tuple[int, float], ...]]]


@pytest.fixture(scope="module")
def blocks(bundled_blocks: ss.Model) -> ss.Model:
    """The default load (tests/conftest.py's session copy): the file's blocks."""
    assert ss.artifact.weight_format("bundled", "auto", bundled_blocks.kernels) == "gguf"
    return bundled_blocks


@pytest.fixture
def engines(blocks: ss.Model) -> Iterator[Callable[..., ss.Engine]]:
    made: list[ss.Engine] = []

    def make(**config: Any) -> ss.Engine:
        made.append(ss.Engine(blocks, ss.EngineConfig(max_seqs=5, max_context=96, **config)))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
        engine.check_integrity()


def trace(handle: ss.RequestHandle) -> Trace:
    """Each generated token with its log-probability and its top 5 (exact floats)."""
    return [
        (e.token_id, e.logprob, e.top_logprobs)
        for e in handle
        if isinstance(e, ss.TokenEvent) and e.token_id >= 0
    ]


def params(**extra: Any) -> ss.SamplingParams:
    return ss.SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5, **extra)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_batched_equals_alone(
    blocks: ss.Model, engines: Callable[..., ss.Engine], layout: str, kv_dtype: str
) -> None:
    ids = [blocks.tokenizer.encode(p) for p in PROMPTS]
    greedy = params(temperature=0)
    engine = engines(**LAYOUTS[layout], kv_dtype=kv_dtype)
    alone = [trace(engine.submit(p, greedy)) for p in ids]
    # Together, in one fifo engine whose prefill chunks of 3 tokens interleave with decodes
    # and with a background request of its own.
    mixed = engines(**LAYOUTS[layout], kv_dtype=kv_dtype, policy="fifo", prefill_chunk=3)
    handles = [mixed.submit(p, greedy) for p in ids]
    noise = mixed.submit(ids[0] * 3, greedy, priority="background")
    together = [trace(h) for h in handles]
    trace(noise)
    for mine, reference in zip(together, alone, strict=True):
        assert mine == reference


def test_a_seed_gives_the_same_text_whatever_the_batch(
    blocks: ss.Model, engines: Callable[..., ss.Engine]
) -> None:
    ids = [blocks.tokenizer.encode(p) for p in PROMPTS]
    sampled = params(temperature=0.9, top_p=0.95, seed=7)
    engine = engines(kv_layout="cell")
    alone = [trace(engine.submit(p, sampled)) for p in ids]
    mixed = engines(kv_layout="cell", policy="fifo", prefill_chunk=2)
    handles = [mixed.submit(p, sampled) for p in ids]
    assert [trace(h) for h in handles] == alone


def test_a_restored_prefix_gives_the_same_log_probabilities(
    blocks: ss.Model, engines: Callable[..., ss.Engine]
) -> None:
    """Cache on = cache off, compared on every token's log-probabilities, not only the
    greedy tokens (a near-tie would hide a numeric difference)."""
    system = blocks.tokenizer.encode("You are a careful assistant. Answer in one sentence.")
    prompts = [system + blocks.tokenizer.encode(q) for q in (" Why is the sky blue?", " Hi.")]
    greedy = params(temperature=0)
    off = engines(kv_layout="cell", block_size=8)
    expected = [trace(off.submit(p, greedy)) for p in prompts + prompts[:1]]
    on = engines(kv_layout="cell", block_size=8, prefix_cache_bytes="16MiB")
    handles = []
    for prompt in prompts + prompts[:1]:
        handles.append(on.submit(prompt, greedy))
        assert trace(handles[-1]) == expected[len(handles) - 1]
    restored = [h.result().usage.cached_tokens for h in handles]
    assert restored[0] == 0 and all(n >= len(system) // 8 * 8 for n in restored[1:])
