"""`Stats` as ExecuTorch 1.5.1's (issue 52, item 4): the model-execution fields measured (the
time inside the model's forward passes), ``reset``, ``to_json_string``,
``on_sampling_begin``/``on_sampling_end``, and ``num_generated_tokens`` counted as 1.5.1
counts it: the decode steps' tokens (ExecuTorch's ``pos - start_pos`` after its decode
loop), every sampled token but the first, which prefill produced; an EOS that ends the turn
is one of them."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

import slotserve as ss
from slotserve.runner import GenerationConfig

GREEDY = GenerationConfig(echo=False, temperature=0, max_new_tokens=12, ignore_eos=True)
FORWARD_S = 0.02
# How far a generation's model-execution time may exceed its forwards' own: each window
# also holds the executor's bookkeeping around the forward (and whatever the OS takes from
# it on a loaded machine), but never another forward, which would add at least FORWARD_S.
SLACK_MS = FORWARD_S * 1000 / 2


@pytest.fixture
def slow_forward(tiny: ss.Model, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The tiny model's forward pass, FORWARD_S longer; the seconds of each call."""
    forward = tiny.forward
    calls: list[float] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        time.sleep(FORWARD_S)
        try:
            return forward(*args, **kwargs)
        finally:
            calls.append(time.monotonic() - began)

    monkeypatch.setattr(tiny, "forward", slow)
    return calls


def test_model_execution_is_the_time_inside_the_forward_passes(
    tiny: ss.Model, slow_forward: list[float]
) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.load()
    slow_forward.clear()  # the engine's start-up probes are no generation's
    stats = runner.generate([5, 6, 7], GREEDY).stats
    assert len(slow_forward) == 12  # one prefill step, 11 decode steps
    measured_ms = sum(slow_forward) * 1000
    # Summed in nanoseconds (truncated to whole ms: at most 1 below), never a forward more
    # than those of this generation; and no more than the inference span (sampling and the
    # engine's bookkeeping are outside).
    assert measured_ms - 1 <= stats.aggregate_model_execution_time_ms <= measured_ms + SLACK_MS
    assert stats.aggregate_model_execution_time_ms >= 12 * FORWARD_S * 1000
    assert stats.aggregate_model_execution_time_ms <= (
        stats.inference_end_ms - stats.inference_start_ms
    )
    # The latest window is the last decode step's: after the first token, before the end.
    assert (
        stats.prompt_eval_end_ms
        <= stats.model_execution_start_ms
        <= stats.model_execution_end_ms
        <= stats.inference_end_ms
    )
    assert stats.model_execution_end_ms - stats.model_execution_start_ms >= FORWARD_S * 1000 - 1
    data = json.loads(stats.to_json())
    assert data["aggregate_model_execution_time_ms"] == stats.aggregate_model_execution_time_ms
    assert data["model_execution_start_ms"] == stats.model_execution_start_ms > 0


def test_each_generation_times_only_its_own_forwards(
    tiny: ss.Model, slow_forward: list[float]
) -> None:
    """A prefill's forwards are not a generation's (ExecuTorch's prefill reports no stats),
    and a second turn's stats start from zero."""
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill(list(range(5, 45)))  # 40 tokens: one step, not timed
    slow_forward.clear()
    first = runner.generate([], GenerationConfig(echo=False, temperature=0, max_new_tokens=3))
    assert len(slow_forward) == 2  # the prediction is the first token: 2 decode steps
    spent = sum(slow_forward) * 1000
    assert spent - 1 <= first.stats.aggregate_model_execution_time_ms <= spent + SLACK_MS
    slow_forward.clear()
    second = runner.generate([50], GREEDY)
    spent = sum(slow_forward) * 1000
    assert spent - 1 <= second.stats.aggregate_model_execution_time_ms <= spent + SLACK_MS


def test_reset_zeroes_the_generation_and_keeps_the_load() -> None:
    stats = ss.Stats(
        model_load_start_ms=1,
        model_load_end_ms=2,
        inference_start_ms=10,
        token_encode_end_ms=11,
        model_execution_start_ms=12,
        model_execution_end_ms=13,
        prompt_eval_end_ms=20,
        first_token_ms=20,
        inference_end_ms=70,
        aggregate_sampling_time_ms=3,
        aggregate_model_execution_time_ms=40,
        num_prompt_tokens=5,
        num_generated_tokens=10,
        gpu_total_bytes=1000,
        gpu_peak_usage_mb=1.5,
        prompt_tokens_computed=5,
        prompt_tokens_restored=2,
    )
    stats.on_sampling_begin()
    stats.reset()
    assert stats == ss.Stats(model_load_start_ms=1, model_load_end_ms=2)
    stats.on_sampling_end()  # the window open before the reset was dropped with it
    assert stats.aggregate_sampling_time_ms == 0
    stats.reset(all_stats=True)
    assert stats == ss.Stats()
    assert list(json.loads(stats.to_json_string())) == list(json.loads(ss.Stats().to_json()))


def test_to_json_string_is_to_json() -> None:
    stats = ss.Stats(inference_start_ms=10, prompt_eval_end_ms=20, num_prompt_tokens=4)
    assert stats.to_json_string() == stats.to_json()
    assert json.loads(stats.to_json_string())["prefill_token_per_sec"] == 400.0


def test_sampling_windows_add_up_to_whole_milliseconds() -> None:
    stats = ss.Stats()
    stats.on_sampling_begin()
    time.sleep(0.003)
    stats.on_sampling_end()
    assert stats.aggregate_sampling_time_ms >= 3
    stats.reset()
    # Sub-millisecond windows: ExecuTorch adds each call's whole milliseconds (0 each);
    # these add their nanoseconds, so 20 windows of at least 0.2 ms give at least 4 ms.
    for _ in range(20):
        stats.on_sampling_begin()
        time.sleep(0.0002)
        stats.on_sampling_end()
    assert stats.aggregate_sampling_time_ms >= 4
    before = stats.aggregate_sampling_time_ms
    stats.on_sampling_end()  # no open window: nothing added
    assert stats.aggregate_sampling_time_ms == before


def test_model_execution_windows_outside_a_generation() -> None:
    stats = ss.Stats()
    stats.on_model_execution_end()  # none open: nothing
    assert (stats.model_execution_end_ms, stats.aggregate_model_execution_time_ms) == (0, 0)
    stats.on_model_execution_begin()
    time.sleep(0.002)
    stats.on_model_execution_end()
    assert stats.model_execution_end_ms >= stats.model_execution_start_ms + 2
    assert stats.aggregate_model_execution_time_ms >= 2


# -- num_generated_tokens, as 1.5.1 counts it ------------------------------------------


def decode_steps(result: ss.GenerationResult, first_from_prefill: bool = True) -> int:
    """ExecuTorch 1.5.1's count: its decode loop runs one step per token it samples after
    the first (which its prefill sampled), and returns the steps run."""
    sampled = len(result.tokens) + (result.eos_token is not None)
    return sampled - 1 if first_from_prefill and sampled else 0


def test_a_run_to_its_length_counts_one_less_than_its_tokens(tiny: ss.Model) -> None:
    result = ss.TextLLMRunner(tiny, max_context=64).generate([5, 6, 7], GREEDY)
    assert len(result.tokens) == 12 and result.finish_reason == "length"
    assert result.stats.num_generated_tokens == 11 == decode_steps(result)


def test_an_eos_that_ends_the_turn_is_counted(tiny: ss.Model) -> None:
    until_eos = GenerationConfig(echo=False, temperature=0, max_new_tokens=40)
    result = ss.TextLLMRunner(tiny, max_context=64).generate([13, 3], until_eos)
    assert result.finish_reason == "stop" and result.eos_token in tiny.tokenizer.eos_ids
    assert len(result.tokens) == 5  # then the EOS, sampled by the fifth decode step
    assert result.stats.num_generated_tokens == 5 == decode_steps(result)


def test_an_eos_first_token_generates_nothing(tiny: ss.Model) -> None:
    """The prompt's first greedy token is EOS: the turn ends there, no decode step ran.
    (ExecuTorch 1.5.1 checks EOS only on decode steps' tokens, so it decodes past it.)"""
    until_eos = GenerationConfig(echo=False, temperature=0, max_new_tokens=40)
    result = ss.TextLLMRunner(tiny, max_context=64).generate([4, 129], until_eos)
    assert (result.tokens, result.finish_reason) == ([], "stop")
    assert result.stats.num_generated_tokens == 0 == decode_steps(result)


def test_a_stopped_run_counts_the_tokens_it_gave(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=256)
    seen: list[str] = []

    def on_token(piece: str) -> None:
        seen.append(piece)
        if len(seen) == 4:
            runner.stop()

    config = GenerationConfig(echo=False, temperature=0, max_new_tokens=200, ignore_eos=True)
    result = runner.generate([5, 6, 7], config, token_callback=on_token)
    assert result.finish_reason == "cancelled" and len(result.tokens) == 4
    assert result.stats.num_generated_tokens == 3 == decode_steps(result)


def test_after_prefill_the_prediction_is_the_first_token(tiny: ss.Model) -> None:
    runner = ss.TextLLMRunner(tiny, max_context=64)
    runner.prefill([5, 6, 7])
    result = runner.generate([], GREEDY)
    assert len(result.tokens) == 12
    assert result.stats.num_generated_tokens == 11 == decode_steps(result)
