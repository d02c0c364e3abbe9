"""TextLLMRunner: ExecuTorch's rules for max_new_tokens, multi-turn positions, stop, stats."""

from __future__ import annotations

import json
import threading

import pytest

import slotserve as ss
from slotserve.runner import GenerationConfig


@pytest.mark.parametrize(
    "max_new,seq_len,expected",
    [
        (-1, -1, 100 - 30),  # both unset: C - O
        (20, -1, 20),  # only max_new_tokens: min(max_new, C - O)
        (500, -1, 70),
        (-1, 50, 50 - 30),  # only seq_len: min(seq_len, C) - O
        (-1, 500, 100 - 30),
        (10, 50, 10),  # both: min(min(seq_len, C) - O, max_new)
        (40, 50, 20),
        (40, 500, 40),
        (-1, 20, 0),  # clamped at 0
        (5, 10, 0),
    ],
)
def test_resolve_max_new_tokens(max_new: int, seq_len: int, expected: int) -> None:
    config = GenerationConfig(max_new_tokens=max_new, seq_len=seq_len)
    assert config.resolve_max_new_tokens(100, 30) == expected


def test_resolve_never_negative_when_context_full() -> None:
    assert GenerationConfig().resolve_max_new_tokens(10, 12) == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=-2)
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)


GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=12, ignore_eos=True)


def test_generate_is_greedy_argmax_of_the_model(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    result = runner.generate([5, 6, 7], GREEDY)
    ids = [5, 6, 7]
    for token in result.tokens:
        assert tiny.logits(ids)[-1].argmax().item() == token
        ids.append(token)
    assert result.finish_reason == "length" and len(result.tokens) == 12


def test_multi_turn_continues_and_reset_starts_over(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    first = runner.generate([5, 6, 7], GREEDY)
    assert runner.position == 3 + 11  # the last token is sampled, not yet fed
    second = runner.generate([8, 9], GREEDY)
    whole = [5, 6, 7, *first.tokens, 8, 9]
    fresh = ss.TextLLMRunner(tiny, max_context=64).generate(whole, GREEDY)
    assert second.tokens == fresh.tokens
    runner.reset()
    assert runner.generate([5, 6, 7], GREEDY).tokens == first.tokens


def test_generate_from_pos_rewinds(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.generate([5, 6, 7, 8, 9], GREEDY)
    rewound = runner.generate_from_pos([10, 11], 3, GREEDY)
    fresh = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7, 10, 11], GREEDY)
    assert rewound.tokens == fresh.tokens
    with pytest.raises(ValueError, match="start_pos"):
        runner.generate_from_pos([1], 999, GREEDY)


def test_stop_from_another_thread_ends_before_next_token(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=256)
    seen: list[str] = []
    stopped_after = threading.Event()

    def on_token(piece: str) -> None:
        seen.append(piece)
        if len(seen) == 3:
            thread = threading.Thread(target=runner.stop)
            thread.start()
            thread.join()
            stopped_after.set()

    config = GenerationConfig(echo=False, temperature=0, max_new_tokens=200, ignore_eos=True)
    result = runner.generate([5, 6, 7], config, token_callback=on_token)
    assert stopped_after.is_set()
    assert result.finish_reason == "cancelled"
    assert len(result.tokens) == 3


def test_context_overflow_is_refused(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=8)
    with pytest.raises(ss.ContextOverflow):
        runner.generate(list(range(3, 13)), GREEDY)
    result = runner.generate(
        [5, 6, 7], GenerationConfig(echo=False, temperature=0, ignore_eos=True)
    )
    assert len(result.tokens) == 8 - 3  # C - O


def test_stats_callback_and_json(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    got: list[ss.Stats] = []
    result = runner.generate("hello", GREEDY, stats_callback=got.append)
    stats = got[0]
    assert stats is result.stats
    assert stats.num_prompt_tokens == 5 and stats.num_generated_tokens == 12
    assert (
        stats.inference_start_ms
        <= stats.prompt_eval_end_ms
        <= stats.first_token_ms
        <= stats.inference_end_ms
    )
    data = json.loads(stats.to_json())
    assert data["num_generated_tokens"] == 12
    assert data["SCALING_FACTOR_UNITS_PER_SECOND"] == 1000


def test_echo_and_bos(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    pieces: list[str] = []
    config = GenerationConfig(echo=True, temperature=0, max_new_tokens=2, num_bos=1)
    result = runner.generate("hi", config, token_callback=pieces.append)
    assert pieces[0] == "hi"
    assert result.stats.num_prompt_tokens == 3  # BOS + 2 bytes


def test_warming_leaves_no_trace(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    warm = runner.generate(
        [5, 6], GenerationConfig(echo=False, temperature=0, max_new_tokens=4, warming=True)
    )
    cold = ss.TextLLMRunner(tiny, max_context=64).generate(
        [5, 6], GenerationConfig(echo=False, temperature=0, max_new_tokens=4)
    )
    assert warm.tokens == cold.tokens


def test_stop_strings_end_generation(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    full = runner.generate([5, 6, 7], GREEDY).text
    runner.reset()
    assert len(full) > 4
    stop = full[3:5]
    result = runner.generate(
        [5, 6, 7],
        GenerationConfig(
            echo=False, temperature=0, max_new_tokens=12, stop=(stop,), ignore_eos=True
        ),
    )
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]


def test_seeded_sampling_reproduces(tiny: ss.Model) -> None:
    config = GenerationConfig(
        echo=False, temperature=1.0, seed=42, max_new_tokens=10, ignore_eos=True
    )
    a = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6], config)
    b = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6], config)
    assert a.tokens == b.tokens
