"""TextLLMRunner: ExecuTorch's rules for max_new_tokens, multi-turn positions, stop, stats."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits
from slotserve.runner import GenerationConfig, common_prefix


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
        assert teacher_forced_logits(tiny, ids)[-1].argmax().item() == token
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
    # ExecuTorch counts the decode steps' tokens: all 12 but the first, which prefill made.
    assert len(result.tokens) == 12
    assert stats.num_prompt_tokens == 5 and stats.num_generated_tokens == 11
    assert (
        stats.inference_start_ms
        <= stats.token_encode_end_ms
        <= stats.prompt_eval_end_ms
        <= stats.first_token_ms
        <= stats.inference_end_ms
    )
    data = json.loads(stats.to_json())
    assert data["prompt_tokens"] == 5 and data["generated_tokens"] == 11
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


# -- issue 9.6: a failing token callback ------------------------------------------------


def test_a_raising_token_callback_releases_the_slot(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=512)
    seen: list[str] = []

    def failing(piece: str) -> None:
        seen.append(piece)
        if len(seen) == 2:
            raise RuntimeError("the client went away")

    long_run = GenerationConfig(echo=False, temperature=0, ignore_eos=True)  # ~500 tokens
    with pytest.raises(RuntimeError, match="went away"):
        runner.generate([5, 6, 7], long_run, token_callback=failing)
    assert runner.position == 0  # the failed turn left nothing in the conversation
    # The one slot is free again at once: no slots_full refusal.
    assert runner.generate([5, 6, 7], GREEDY).tokens == (
        ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY).tokens
    )


# -- issue 9.10: ExecuTorch's semantics ---------------------------------------------------

# The keys stats_to_json_string (extension/llm/runner/stats.h) writes, in its order.
EXECUTORCH_JSON_KEYS = [
    "prefill_token_per_sec",
    "decode_token_per_sec",
    "prompt_tokens",
    "generated_tokens",
    "model_load_start_ms",
    "model_load_end_ms",
    "inference_start_ms",
    "inference_end_ms",
    "model_execution_start_ms",
    "model_execution_end_ms",
    "prompt_eval_end_ms",
    "first_token_ms",
    "aggregate_sampling_time_ms",
    "aggregate_model_execution_time_ms",
    "SCALING_FACTOR_UNITS_PER_SECOND",
]


def test_stats_json_is_executorchs() -> None:
    stats = ss.Stats(
        model_load_start_ms=1,
        model_load_end_ms=2,
        inference_start_ms=10,
        token_encode_end_ms=11,
        prompt_eval_end_ms=20,
        first_token_ms=20,
        inference_end_ms=70,
        aggregate_sampling_time_ms=3,
        num_prompt_tokens=5,
        num_generated_tokens=10,
    )
    data = json.loads(stats.to_json())
    assert list(data) == EXECUTORCH_JSON_KEYS  # no token_encode_end_ms, no num_* names
    assert data["prefill_token_per_sec"] == 5 / (20 - 10) * 1000
    # decode: generated tokens over inference end - prompt eval end
    assert data["decode_token_per_sec"] == 10 / (70 - 20) * 1000
    assert data["prompt_tokens"] == 5 and data["generated_tokens"] == 10
    assert data["aggregate_sampling_time_ms"] == 3
    assert stats.prefill_tokens_per_s == data["prefill_token_per_sec"]
    assert stats.decode_tokens_per_s == data["decode_token_per_sec"]


def test_stats_json_leaves_out_rates_of_empty_spans_and_unknown_gpu_figures() -> None:
    data = json.loads(ss.Stats(num_prompt_tokens=3).to_json())
    assert list(data) == EXECUTORCH_JSON_KEYS[2:]
    assert ss.Stats().decode_tokens_per_s is None
    with_gpu = json.loads(ss.Stats(gpu_total_bytes=1000, gpu_peak_usage_mb=1.5).to_json())
    gpu_keys = [k for k in with_gpu if k.startswith("gpu_")]
    assert gpu_keys == ["gpu_total_bytes", "gpu_peak_usage_mb"]
    assert list(with_gpu)[-1] == "SCALING_FACTOR_UNITS_PER_SECOND"


def test_inference_starts_before_the_prompt_is_encoded(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    encode = tiny.tokenizer.encode

    def slow_encode(text: str, **kwargs: Any) -> list[int]:
        time.sleep(0.05)
        return encode(text, **kwargs)

    monkeypatch.setattr(tiny.tokenizer, "encode", slow_encode)
    stats = ss.TextLLMRunner(tiny, max_context=64).generate("hello", GREEDY).stats
    assert stats.token_encode_end_ms - stats.inference_start_ms >= 45
    assert stats.token_encode_end_ms <= stats.prompt_eval_end_ms


def test_generation_stats_follow_executorch(tiny: ss.Model) -> None:
    result = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY)
    stats = result.stats
    assert stats.num_prompt_tokens == 3
    assert stats.num_generated_tokens == len(result.tokens) - 1
    # Prefill ends when it has sampled the first token; ExecuTorch takes both there.
    assert stats.prompt_eval_end_ms == stats.first_token_ms
    data = json.loads(stats.to_json())
    span = stats.inference_end_ms - stats.prompt_eval_end_ms
    if span > 0:
        assert data["decode_token_per_sec"] == stats.num_generated_tokens / span * 1000


def test_sampling_time_is_the_engines(tiny: ss.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    import slotserve.engine.stepper as stepper

    sample = stepper.sample_batch

    def slow_sample(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.005)
        return sample(*args, **kwargs)

    monkeypatch.setattr(stepper, "sample_batch", slow_sample)
    stats = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY).stats
    assert stats.aggregate_sampling_time_ms >= 12 * 5  # 12 sampling calls of >= 5 ms
    span = stats.inference_end_ms - stats.inference_start_ms
    assert stats.aggregate_sampling_time_ms <= span + 1  # + 1: whole milliseconds


def test_a_prompt_that_fills_the_context_is_refused(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=8)
    # ExecuTorch: pos + num_prompt_tokens must be < max_context_len.
    with pytest.raises(ss.ContextOverflow, match=r"prompt 8 tokens.*max_context=8"):
        runner.generate(list(range(3, 11)), GREEDY)
    assert runner.position == 0
    one_left = GenerationConfig(echo=False, temperature=0, ignore_eos=True)
    assert len(runner.generate(list(range(3, 10)), one_left).tokens) == 1


def test_a_conversation_that_fills_the_context_is_refused(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=16)
    runner.generate([5, 6, 7], GenerationConfig(echo=False, temperature=0, ignore_eos=True))
    assert runner.position == 15  # 3 + 13 sampled, the last one fed next turn
    with pytest.raises(ss.ContextOverflow, match="holds 15 positions and the prompt 2 tokens"):
        runner.generate([8], GREEDY)
    assert runner.position == 15  # unchanged by the refusal


def test_a_budget_that_resolves_to_zero_is_refused(tiny: ss.Model) -> None:
    # ExecuTorch refuses when resolve_max_new_tokens gives <= 0 ("Max new tokens ... is
    # less than or equal to 0"), instead of running a prefill that yields nothing.
    runner = ss.TextLLMRunner(tiny, max_context=64)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        runner.generate([5, 6, 7], GenerationConfig(echo=False, max_new_tokens=0))
    with pytest.raises(ss.ContextOverflow, match="seq_len=3"):
        runner.generate([5, 6, 7], GenerationConfig(echo=False, seq_len=3))
    assert runner.position == 0
    one_token = GenerationConfig(echo=False, temperature=0, seq_len=4, ignore_eos=True)
    assert len(runner.generate([5, 6, 7], one_token).tokens) == 1


def _count_submits(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    submits: list[object] = []
    submit = ss.Engine.submit

    def counting(self: ss.Engine, *args: Any, **kwargs: Any) -> Any:
        submits.append(args[0])
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(ss.Engine, "submit", counting)
    return submits


def test_warming_is_one_ordinary_run_without_the_report(
    tiny: ss.Model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="slotserve.runner")
    submits = _count_submits(monkeypatch)
    runner = ss.TextLLMRunner(tiny, max_context=64)
    pieces: list[str] = []
    got: list[ss.Stats] = []
    warm_config = replace(GREEDY, warming=True)
    warm = runner.generate(
        [5, 6], warm_config, token_callback=pieces.append, stats_callback=got.append
    )
    # ExecuTorch's generate() with warming runs the generation once, as any other (the
    # caller's callbacks included, the position advanced); it only keeps its report quiet.
    assert len(submits) == 1
    assert "".join(pieces) == warm.text and got == [warm.stats]
    assert runner.position == 2 + len(warm.tokens) - 1
    reports = [r for r in caplog.records if "PyTorchObserver" in r.getMessage()]
    assert [r.levelno for r in reports] == [logging.DEBUG]
    caplog.clear()
    cold = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6], GREEDY)
    assert warm.tokens == cold.tokens
    reports = [r for r in caplog.records if "PyTorchObserver" in r.getMessage()]
    assert [r.levelno for r in reports] == [logging.INFO]
    assert json.loads(reports[0].getMessage().split(" ", 1)[1]) == cold.stats.to_dict()


def test_warmup_runs_once_then_resets(tiny: ss.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    submits = _count_submits(monkeypatch)
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.load()
    runner.warmup([5, 6, 7], 4)
    assert len(submits) == 1
    assert runner.position == 0
    assert runner.stats.model_load_end_ms > 0  # kept, as Stats::reset() keeps it
    assert runner.stats.inference_start_ms == runner.stats.num_generated_tokens == 0
    after = runner.generate([5, 6, 7], GREEDY)
    assert after.tokens == ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY).tokens


# -- issue 13: the conversation's KV stays cached between turns -------------------------
# (The tiny models here run dense weights, where restoring is not bit-exact and the cache
# is off unless asked: these ask, prefix_cache=True; issue 52 tests the default rule.)


def _chat(runner: ss.TextLLMRunner, turns: list[list[int]]) -> list[ss.GenerationResult]:
    """`slotserve chat`'s loop on token-level messages: each turn's conversation is the
    previous one plus the reply and the new message; only what differs is placed after
    the longest prefix the runner holds."""
    results, in_conversation = [], []
    for message in turns:
        tokens = [*in_conversation, *message]
        keep = common_prefix(in_conversation, tokens, runner.position)
        result = runner.generate_from_pos(tokens[keep:], keep, GREEDY)
        results.append(result)
        in_conversation = tokens + result.tokens
    return results


def test_chat_turns_restore_the_conversation_instead_of_prefilling_it(tiny: ss.Model) -> None:
    turns = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18], [19, 20]]
    cached = _chat(ss.TextLLMRunner(tiny, max_context=256, prefix_cache=True), turns)
    plain = _chat(ss.TextLLMRunner(tiny, max_context=256, prefix_cache=False), turns)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]  # token for token
    computed = [r.stats.prompt_tokens_computed for r in cached]
    for message, result, n in zip(turns, cached, computed, strict=True):
        # The turn's new tokens (the last reply token, never fed, then the message)
        # and at most one replayed token: flat, not growing with the conversation.
        assert n <= result.stats.num_prompt_tokens + 1 <= len(message) + 2
    restored = [r.stats.prompt_tokens_restored for r in cached]
    assert restored[0] == 0 and all(a < b for a, b in itertools.pairwise(restored))
    whole = [r.stats.prompt_tokens_computed for r in plain]  # without the cache: growing
    assert whole == [r + c for r, c in zip(restored, computed, strict=True)]
    assert all(a < b for a, b in itertools.pairwise(whole))


def test_chat_on_a_sliding_window_model_restores_past_the_window(
    tiny_dirs: dict[str, Path],
) -> None:
    mixed = ss.load(tiny_dirs["mixed"])  # sliding-window layers keep their last 5 positions
    turns = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18], [19, 20]]
    cached = _chat(ss.TextLLMRunner(mixed, max_context=256, prefix_cache=True), turns)
    plain = _chat(ss.TextLLMRunner(mixed, max_context=256, prefix_cache=False), turns)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]
    for result in cached[1:]:
        assert result.stats.prompt_tokens_computed <= result.stats.num_prompt_tokens + 1
        assert result.stats.prompt_tokens_restored > 5


def test_generate_continues_from_the_cached_conversation(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64, prefix_cache=True)
    first = runner.generate([5, 6, 7], GREEDY)
    second = runner.generate([8, 9], GREEDY)
    # Computed: the pending last token of the first turn and the two new ones.
    assert second.stats.num_prompt_tokens == 3 == second.stats.prompt_tokens_computed
    assert second.stats.prompt_tokens_restored == 3 + len(first.tokens) - 1
    rewound = runner.generate_from_pos([10, 11], 3, GREEDY)  # inside the cached turn
    assert rewound.stats.prompt_tokens_restored == 3
    fresh = ss.TextLLMRunner(tiny, max_context=64, prefix_cache=False)
    assert rewound.tokens == fresh.generate([5, 6, 7, 10, 11], GREEDY).tokens


def test_the_prefill_rate_counts_computed_tokens_only(tiny: ss.Model) -> None:
    """The same 120-token prompt twice: the second run restores 119 positions and computes
    one, and its prefill rate is that one over a span that includes the restore (not 120
    over it, which read 120,000 tok/s); a regenerate from inside the prompt likewise."""
    prompt = [3 + i % 200 for i in range(120)]
    runner = ss.TextLLMRunner(tiny, max_context=256, prefix_cache=True)
    cold = runner.generate(prompt, GREEDY)
    runner.reset()
    repeat = runner.generate(prompt, GREEDY)
    regenerated = runner.generate_from_pos(prompt[100:], 100, GREEDY)
    assert cold.stats.prompt_tokens_computed == 120
    assert (repeat.stats.prompt_tokens_restored, repeat.stats.prompt_tokens_computed) == (119, 1)
    assert regenerated.stats.prompt_tokens_computed < len(prompt[100:]) + 1
    # The repeat's figures, with a 10 ms span: 1 computed token is 100 tok/s, not 12,000.
    timed = ss.Stats(
        inference_start_ms=10, prompt_eval_end_ms=20, num_prompt_tokens=120,
        prompt_tokens_computed=1, prompt_tokens_restored=119,
    )  # fmt: skip
    assert timed.prefill_tokens_per_s == 100.0
    for result in (cold, repeat, regenerated):
        stats = result.stats
        span = stats.prompt_eval_end_ms - stats.inference_start_ms
        if span > 0:
            expected = stats.prompt_tokens_computed / span * 1000
            assert stats.prefill_tokens_per_s == expected
            assert json.loads(stats.to_json())["prefill_token_per_sec"] == expected


def test_a_turn_that_reserves_the_whole_context_still_restores(tiny: ss.Model) -> None:
    # The one-slot pool has no block to spare: the turn takes over the cached
    # conversation's blocks (the snapshot is consumed) instead of computing it again.
    unbounded = GenerationConfig(echo=False, temperature=0, ignore_eos=True)
    results = []
    for cache in (True, False):
        runner = ss.TextLLMRunner(tiny, max_context=40, prefix_cache=cache)
        runner.generate([5, 6, 7, 8, 9], GREEDY)
        results.append(runner.generate([10, 11], unbounded))
    cached, plain = results
    assert cached.tokens == plain.tokens and len(cached.tokens) == 40 - 5 - 11 - 3
    assert cached.stats.prompt_tokens_restored == 5 + 11
    assert cached.stats.prompt_tokens_computed == 3
