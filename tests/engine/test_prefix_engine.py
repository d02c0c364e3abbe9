"""The prefix cache in the engine: cache on = cache off token for token (greedy), restored
tokens counted apart, the cache yields under KV pressure, cancellation and close leave
nothing pinned or leaked, and configurations that could give a stale hit are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.engine import PrefixStats

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
CELL: dict[str, Any] = {"kv_layout": "cell", "block_size": 8, "max_seqs": 2, "max_context": 160}


def family(system: list[int], n: int = 4) -> list[list[int]]:
    """Prompts sharing ``system``: different questions, a repeat, the system prompt alone
    and one that stops inside it."""
    questions = [[*system, 40 + i, 90 + 3 * i, 7] for i in range(n)]
    return [*questions, questions[0], system, system[: len(system) // 2 + 1]]


def prefix_stats(engine: ss.Engine) -> PrefixStats:
    """The engine's prefix-cache figures (the cache must be on)."""
    stats = engine.stats().prefix
    assert stats is not None, "the prefix cache is off"
    return stats


def check_next_turn_restores(
    engine: ss.Engine, uncached: ss.Engine, prompt: list[int], first: ss.Finished
) -> None:
    """``prompt``'s next turn (its reply, a new message) after ``engine`` published its
    completion: the uncached engine's tokens, its whole history restored."""
    turn = [*prompt, *first.tokens[:-1], 60, 61]
    expected = uncached.submit(turn, GREEDY).result()
    engine.submit(prompt, GREEDY, publish_completion=True).result()
    followed = engine.submit(turn, GREEDY).result()
    assert followed.tokens == expected.tokens
    assert followed.usage.cached_tokens == len(prompt) + len(first.tokens) - 1


def run_all(engine: ss.Engine, prompts: list[list[int]]) -> list[ss.Finished]:
    finals = []
    for prompt in prompts:
        finals.append(engine.submit(prompt, GREEDY).result())
        engine.check_integrity()
    return finals


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen3"])
def test_cache_on_equals_cache_off_on_tiny_models(
    kind: str, tiny_dirs: dict[str, Path], make_engine: Callable[..., ss.Engine]
) -> None:
    model = ss.load(tiny_dirs[kind])
    prompts = family([5 + (i * 37) % 200 for i in range(61)])  # 61: ends mid-block
    off = run_all(make_engine(model, **CELL), prompts)
    engine = make_engine(model, **CELL, prefix_cache_bytes="1MiB")
    on = run_all(engine, prompts)
    assert [f.tokens for f in on] == [f.tokens for f in off]
    restored = [f.usage.cached_tokens for f in on]
    assert restored == [0, 61, 61, 61, 63, 60, 30]  # a full match replays its last token
    for final in on:
        timings = final.timings
        assert timings.prompt_tokens_restored == final.usage.cached_tokens
        assert (
            timings.prompt_tokens_computed
            == final.usage.prompt_tokens - timings.prompt_tokens_restored
        )
    stats = prefix_stats(engine)
    assert (stats.hits, stats.misses) == (6, 1)
    assert stats.tokens_restored == sum(restored) and stats.bytes_pinned > 0


def test_cache_on_equals_cache_off_on_the_bundled_model(
    bundled: ss.Model, make_engine: Callable[..., ss.Engine]
) -> None:
    system = bundled.tokenizer.encode(
        "You are a careful assistant. Answer briefly and precisely, in plain English. " * 3
    )
    prompts = [
        system + bundled.tokenizer.encode(q)
        for q in (" Why is the sky blue?", " Name a prime.", " Why is the sea salty?")
    ]
    config = {**CELL, "max_context": 256, "block_size": 16}
    off = run_all(make_engine(bundled, **config), prompts)
    engine = make_engine(bundled, **config, prefix_cache_bytes="64MiB")
    on = run_all(engine, prompts + prompts[:1])
    assert [f.tokens for f in on] == [f.tokens for f in off + off[:1]]
    assert all(f.usage.cached_tokens >= len(system) for f in on[1:])


def test_the_cache_yields_before_a_request_is_refused_kv_exhausted(
    make_engine: Callable[..., ss.Engine],
) -> None:
    engine = make_engine(**CELL, num_blocks=12, prefix_cache_bytes="1MiB")
    for first in (10, 20, 30):
        engine.submit([first] * 24, GREEDY).result()  # each snapshot pins 3 blocks
    assert prefix_stats(engine).snapshots == 3 and engine.stats().kv_blocks_used == 9
    big = engine.submit([50] * 60, GREEDY).result()  # 66 positions: 9 blocks
    assert big.reason == "length"
    assert engine.stats().refusals == {} and prefix_stats(engine).evictions >= 2


def test_cancelling_a_restored_request_leaves_nothing_pinned_or_leaked(
    make_engine: Callable[..., ss.Engine],
) -> None:
    engine = make_engine(**CELL, prefix_cache_bytes="1MiB")
    system = list(range(3, 40))
    engine.submit([*system, 1], GREEDY).result()
    used = engine.stats().kv_blocks_used  # the snapshot's blocks only
    for tail in range(5):
        handle = engine.submit([*system, tail, 2], ss.SamplingParams(max_new_tokens=50))
        handle.cancel(wait=True)  # restored at admission, cancelled at the next boundary
        engine.check_integrity()
        assert engine.prefix is not None and engine.prefix.pins == 0
    stats = engine.stats()
    assert prefix_stats(engine).hits == 5 and stats.cancellations == 5
    assert stats.slots_in_use == 0 and stats.kv_blocks_used >= used
    engine.close()
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0 and prefix_stats(engine).snapshots == 0


def test_close_empties_the_cache_and_returns_the_pool_to_baseline(
    make_engine: Callable[..., ss.Engine],
) -> None:
    engine = make_engine(**CELL, prefix_cache_bytes="1MiB")
    run_all(engine, family(list(range(3, 30))))
    assert prefix_stats(engine).snapshots > 0
    engine.close()
    engine.check_integrity()
    cache = prefix_stats(engine)
    assert (engine.stats().kv_blocks_used, cache.snapshots, cache.bytes_pinned) == (0, 0, 0)


def test_configurations_that_could_serve_a_stale_prefix_are_refused(
    tiny_dirs: dict[str, Path],
) -> None:
    # The ring layout is served under the retention rule (test_the_ring_layout_...), the
    # flat layout by parked slots (test_the_flat_layout_...).
    with pytest.raises(ValueError):
        ss.EngineConfig(kv_layout="cell", prefix_cache_bytes=-1)
    ss.EngineConfig(kv_layout="flat")  # off by default, any layout
    # A model with sliding-window layers is served, under the retention rule (below).


def _mixed_prompts() -> list[list[int]]:
    """Prompts sharing a 20-token system prompt (4x the mixed model's window of 5), and a
    conversation's next turn (the first prompt, its reply, a new message)."""
    system = [5 + (i * 37) % 200 for i in range(20)]
    return family(system, 3)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_sliding_window_layers_reject_a_token_equal_prefix_they_no_longer_hold(
    dtype: str, tiny_dirs: dict[str, Path], make_engine: Callable[..., ss.Engine]
) -> None:
    mixed = ss.load(tiny_dirs["mixed"])  # layers 1 and 3 keep a ring of the last 5
    prompts = _mixed_prompts()
    config = {**CELL, "kv_dtype": dtype}
    off = run_all(make_engine(mixed, **config), prompts)
    engine = make_engine(mixed, **config, prefix_cache_bytes="1MiB")
    on = run_all(engine, prompts)
    assert [f.tokens for f in on] == [f.tokens for f in off]
    # Questions 2 and 3 share the 20 system tokens with question 1's snapshot, but its
    # rings were written up to 23: positions 15..19 they need were overwritten. The
    # repeat of question 1 restores all but its last token (its rings end there).
    restored = [f.usage.cached_tokens for f in on]
    assert restored == [0, 0, 0, 22, 0, 0]
    stats = prefix_stats(engine)
    assert stats.rejections == 4 and stats.rejections_by_rule == {"ring_wrapped": 4}
    # A conversation's next turn extends the snapshot: restored although it is far
    # longer than the window.
    check_next_turn_restores(engine, make_engine(mixed, **config), prompts[0], on[0])


@pytest.mark.parametrize("case", ["mixed model", "ring layout"])
def test_without_the_retention_rule_the_same_scenario_answers_wrong(
    case: str,
    tiny_dirs: dict[str, Path],
    make_engine: Callable[..., ss.Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Proof that the tests of the rule can fail: with `KVPool.retains` always True, the
    stale rings are restored and question 2 gets a different answer from the cache-off
    run."""
    if case == "mixed model":
        model, config = ss.load(tiny_dirs["mixed"]), CELL
        prompts, shared = _mixed_prompts()[:2], 20
    else:
        model, config = ss.load(tiny_dirs["llama"]), {**CELL, **RING}
        prompts, shared = _ring_prompts()[:2], 40
    off = run_all(make_engine(model, **config), prompts)
    monkeypatch.setattr(ss.kv.KVPool, "retains", lambda self, snapshot, upto: True)
    on = run_all(make_engine(model, **config, prefix_cache_bytes="1MiB"), prompts)
    assert on[1].usage.cached_tokens == shared  # the stale hit the rule refuses
    assert on[1].tokens != off[1].tokens


RING: dict[str, Any] = {"kv_layout": "ring", "ring_window": 16, "sinks": 4}


def _ring_prompts() -> list[list[int]]:
    return family([5 + (i * 37) % 200 for i in range(40)], 3)  # 40 > 4 + 16: wrapped


def test_the_ring_layout_after_it_has_wrapped(make_engine: Callable[..., ss.Engine]) -> None:
    ring = {**CELL, **RING}
    prompts = _ring_prompts()
    off = run_all(make_engine(**ring), prompts)
    engine = make_engine(**ring, prefix_cache_bytes="1MiB")
    on = run_all(engine, prompts)
    assert [f.tokens for f in on] == [f.tokens for f in off]
    assert [f.usage.cached_tokens for f in on] == [0, 0, 0, 42, 0, 0]
    assert prefix_stats(engine).rejections_by_rule == {"ring_wrapped": 4}
    # A conversation's next turn continues where the rings end: restored.
    first = engine.submit(prompts[0], GREEDY, publish_completion=True).result()
    turn = [*prompts[0], *first.tokens[:-1], 60, 61]
    expected = make_engine(**ring).submit(turn, GREEDY).result()
    followed = engine.submit(turn, GREEDY).result()
    assert followed.tokens == expected.tokens
    assert followed.usage.cached_tokens == len(prompts[0]) + len(first.tokens) - 1


def test_the_flat_layout_parks_finished_slots_and_copies_nothing_out(
    tiny_dirs: dict[str, Path], make_engine: Callable[..., ss.Engine]
) -> None:
    """A flat pool's snapshots are finished sessions' parked slots: a restore into a free
    slot copies rows inside the pool, one into the parked slot itself copies nothing;
    cache on = cache off, nothing pinned or planned beyond the pool, and every finished
    generation parks (not only the ones that publish their completion)."""
    model = ss.load(tiny_dirs["llama"])
    flat = {"kv_layout": "flat", "max_seqs": 2, "max_context": 160}
    prompts = family([5 + (i * 37) % 200 for i in range(61)])
    off = run_all(make_engine(model, **flat), prompts)
    engine = make_engine(model, **flat, prefix_cache_bytes="1MiB")
    on = run_all(engine, prompts)
    assert [f.tokens for f in on] == [f.tokens for f in off]
    # Each turn restores the system prompt from one of the two parked slots (the last two
    # finished: the repeated first question's own snapshot was evicted by then).
    assert [f.usage.cached_tokens for f in on] == [0, 61, 61, 61, 61, 60, 30]
    stats = prefix_stats(engine)
    assert stats.bytes_pinned == 0 and 1 <= stats.snapshots <= 2
    assert engine.pool.parked_slots == stats.snapshots
    plan = engine.plan
    assert plan.arenas["kv"] == engine.pool.nbytes  # nothing copied out of the pool
    # A conversation's next turn restores its whole history.
    check_next_turn_restores(engine, make_engine(model, **flat), prompts[0], on[0])


def test_a_one_slot_conversation_restores_its_history_in_place(
    tiny_dirs: dict[str, Path], make_engine: Callable[..., ss.Engine]
) -> None:
    """The single-chat shape (flat, one slot): each turn takes the parked slot with its
    rows where they are, restoring everything but the last prompt token, with the tokens
    of an engine that recomputes every turn."""
    model = ss.load(tiny_dirs["llama"])
    one = {"kv_layout": "flat", "max_seqs": 1, "max_context": 160}
    uncached, engine = make_engine(model, **one), make_engine(model, **one, prefix_cache_bytes=1)
    history: list[int] = [5 + (i * 37) % 200 for i in range(20)]
    for turn in range(4):
        prompt = [*history, 60 + turn, 61]
        expected = uncached.submit(prompt, GREEDY).result()
        got = engine.submit(prompt, GREEDY).result()
        assert got.tokens == expected.tokens
        kept = len(history) if turn else 0  # the previous prompt and reply, but the last
        assert got.usage.cached_tokens == kept
        history = [*prompt, *got.tokens[:-1]]
        engine.check_integrity()
        assert engine.pool.parked_slots == 1 and engine.pool.free_slots == 0
