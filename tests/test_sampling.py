"""Sampler transforms, seeding, and stop-string streaming."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.sampling import (
    RequestSampler,
    SamplingParams,
    StopMatcher,
    apply_penalties,
    filter_probs,
    sample_batch,
)


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert RequestSampler(SamplingParams(temperature=0), 4).sample(logits) == 1


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        sampler = RequestSampler(SamplingParams(temperature=1.5, seed=seed), 1000)
        return [sampler.sample(logits) for _ in range(30)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_k_keeps_k() -> None:
    probs = torch.softmax(torch.arange(10.0), -1)
    kept = filter_probs(probs, SamplingParams(top_k=3))
    assert (kept > 0).nonzero().flatten().tolist() == [7, 8, 9]


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_probs(probs, SamplingParams(top_p=0.7))
    assert (kept > 0).tolist() == [True, True, False, False]
    kept = filter_probs(probs, SamplingParams(top_p=0.1))
    assert (kept > 0).tolist() == [True, False, False, False]


def test_min_p_relative_to_top() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    kept = filter_probs(probs, SamplingParams(min_p=0.2))
    assert (kept > 0).tolist() == [True, True, False, False]


def test_sampling_only_draws_allowed_tokens() -> None:
    logits = torch.arange(50.0) / 10
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_k=2, seed=3), 50)
    assert {sampler.sample(logits) for _ in range(100)} == {48, 49}


def test_repetition_penalty_follows_hf_rule() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    seen = torch.tensor([True, True, False])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), seen, torch.zeros(3))
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties() -> None:
    counts = torch.tensor([0.0, 1.0, 3.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(torch.zeros(3), params, counts > 0, counts)
    assert out.tolist() == [0.0, -0.75, -1.25]


def test_batch_sampling_records_tokens() -> None:
    samplers = [RequestSampler(SamplingParams(temperature=0), 4) for _ in range(2)]
    tokens = sample_batch(torch.tensor([[0.0, 1.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]]), samplers)
    assert tokens == [1, 0]
    assert samplers[0].generated_counts[1] == 1 and samplers[1].seen[0]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("max_new_tokens", -1)],
)
def test_invalid_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_must_be_a_tuple_of_strings() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=30),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=30),
)
def test_stop_strings_are_never_emitted(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopMatcher(stops)
    emitted, position, stopped = [], 0, False
    for cut in [*cuts, len(text)]:
        piece = text[position : position + cut]
        position += cut
        out, stopped = matcher.push(piece)
        emitted.append(out)
        if stopped or position >= len(text):
            break
    if not stopped:
        emitted.append(matcher.flush())
    result = "".join(emitted)
    assert not any(s in result for s in stops)
    if stopped:
        # The output is the text up to where a stop string begins, nothing of it after.
        assert text.startswith(result)
        assert any(text[len(result) :].startswith(s) for s in stops)
    else:
        consumed = text[: min(position, len(text))]
        assert result == consumed
        assert not any(s in consumed for s in stops)


def test_degenerate_distributions_fall_back_to_greedy() -> None:
    tiny_temperature = RequestSampler(SamplingParams(temperature=1e-300, seed=1), 4)
    assert tiny_temperature.params.greedy
    assert tiny_temperature.sample(torch.tensor([0.0, 5.0, 1.0, 2.0])) == 1
    with_inf = RequestSampler(SamplingParams(temperature=1.0, seed=1), 3)
    assert with_inf.sample(torch.tensor([0.0, float("inf"), 1.0])) == 1


def test_seed_must_fit_64_bits() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
