"""llama.cpp's samplers (`slotserve.sampling.chain`) against plain-Python readings of their
definitions in llama.cpp's ``src/llama-sampling.cpp``, on fixed and on generated logits;
their state (DRY's history, mirostat's mu) under hypothesis; and batch invariance: a
request's tokens under any of them do not depend on the requests it is batched with.

The references below are written from the definitions, loop by loop as llama.cpp states
them (sorted candidate lists, running sums), independently of the torch code under test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from itertools import pairwise

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slotserve.sampling import RequestSampler, SamplingParams, sample_batch
from slotserve.sampling.chain import (
    Dry,
    Mirostat,
    breaker_sequences,
    held_back,
    top_n_sigma,
    typical,
    xtc,
)

LOGITS = st.lists(
    st.floats(min_value=-20, max_value=20, allow_nan=False, width=32), min_size=2, max_size=40
)


def softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


# -- references ----------------------------------------------------------------------------


def ref_top_n_sigma(logits: list[float], n: float) -> set[int]:
    finite = [v for v in logits if v != -math.inf]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    return {i for i, v in enumerate(logits) if v >= max(finite) - n * std}


def ref_typical(probs: list[float], p: float) -> set[int]:
    live = [i for i, q in enumerate(probs) if q > 0]
    entropy = -sum(probs[i] * math.log(probs[i]) for i in live)
    order = sorted(live, key=lambda i: (abs(-math.log(probs[i]) - entropy), i))
    total = 0.0
    for rank, i in enumerate(order):
        total += probs[i]
        if total > p:
            return set(order[: rank + 1])
    return set(order)


def typical_is_well_posed(probs: list[float], p: float, margin: float = 1e-9) -> bool:
    """Whether typical sampling's answer does not hang on rounding: two tokens' distances
    from the entropy are equal (the index breaks the tie, in both readings) or apart by more
    than ``margin``, and no running sum lies within ``margin`` of ``p``. Otherwise the
    definition's order, or where it stops, depends on the last bit of a sum (as for logits
    [0, 0, 0, -2.2e-16, 0]), and two faithful readings may keep different tokens."""
    live = [i for i, q in enumerate(probs) if q > 0]
    entropy = -sum(probs[i] * math.log(probs[i]) for i in live)
    shifts = sorted(abs(-math.log(probs[i]) - entropy) for i in live)
    if any(0 < b - a <= margin for a, b in pairwise(shifts)):
        return False
    order = sorted(live, key=lambda i: (abs(-math.log(probs[i]) - entropy), i))
    total = 0.0
    for i in order:
        total += probs[i]
        if abs(total - p) <= margin:
            return False
    return True


def ref_xtc(probs: list[float], threshold: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    last = 0
    for rank, i in enumerate(order):
        if probs[i] >= threshold:
            last = rank
        else:
            break
    kept = order[last:] if last > 0 else order
    return {i for i in kept if probs[i] > 0}


def ref_dry(
    tokens: list[int],
    multiplier: float,
    base: float,
    allowed: int,
    breakers: list[tuple[int, ...]],
) -> dict[int, float]:
    """DRY by brute force: for each earlier position, the longest run of tokens ending
    there that equals the run ending at the history's end, no longer than the distance
    back to the last breaker; a token following such a run of at least ``allowed``
    tokens is penalised for the longest run it would extend."""
    n = len(tokens)
    if n <= allowed:
        return {}
    heads: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        heads.setdefault(breaker[0], []).append(tuple(breaker[1:]))
    limit = n
    for back in range(n):
        tails = heads.get(tokens[n - 1 - back], [])
        matches = [
            len(t)
            for t in tails
            if len(t) <= back and list(t) == tokens[n - back : n - back + len(t)]
        ]
        if matches:
            limit = back - max(matches)
            break
    if limit < allowed:
        return {}
    longest: dict[int, int] = {}
    for end in range(n - 1):  # a run ending at `end`, followed by tokens[end + 1]
        run = 0
        while run <= end and tokens[end - run] == tokens[n - 1 - run]:
            run += 1
        run = min(run, limit)
        if run >= allowed:
            longest[tokens[end + 1]] = max(longest.get(tokens[end + 1], 0), run)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = {}
    for token, run in longest.items():
        if () in heads.get(token, []):
            continue
        exponent = run - allowed
        exponent = min(exponent, cap) if cap > 0 else exponent
        out[token] = multiplier * base**exponent
    return out


# -- each sampler against its reference ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(LOGITS, st.floats(min_value=0.01, max_value=4.0))
def test_top_n_sigma_matches_definition(logits: list[float], n: float) -> None:
    out = top_n_sigma(torch.tensor(logits), n)
    kept = {i for i, v in enumerate(out.tolist()) if v != -math.inf}
    reference = ref_top_n_sigma(logits, n)
    # float32 sums against doubles: a logit within rounding of the floor may go either way
    finite = torch.tensor(logits, dtype=torch.float64)
    floor = float(finite.max()) - n * float(finite.std(unbiased=False))
    assert {i for i in kept ^ reference if abs(logits[i] - floor) > 1e-4} == set()


def test_top_n_sigma_fixed() -> None:
    logits = torch.tensor([10.0, 9.0, 1.0, 0.0, -math.inf])
    kept = top_n_sigma(logits, 1.0)
    assert torch.isfinite(kept).tolist() == [True, True, False, False, False]
    assert torch.equal(top_n_sigma(logits, 0.0), logits)  # <= 0: off


@settings(max_examples=200, deadline=None)
@given(LOGITS, st.floats(min_value=0.05, max_value=0.99))
def test_typical_matches_definition(logits: list[float], p: float) -> None:
    probs = softmax(logits)
    assume(typical_is_well_posed(probs, p))
    out = typical(torch.tensor(probs, dtype=torch.float64), p)
    assert {i for i, q in enumerate(out.tolist()) if q > 0} == ref_typical(probs, p)


def test_typical_fixed() -> None:
    # Entropy of [0.5, 0.3, 0.2] is 1.03; surprises 0.69, 1.20, 1.61: 0.3 is the most
    # typical, then 0.5: with p = 0.6 those two are kept.
    out = typical(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), 0.6)
    assert out.tolist() == [0.5, 0.3, 0.0]


@settings(max_examples=200, deadline=None)
@given(LOGITS, st.floats(min_value=0.0, max_value=0.5))
def test_xtc_matches_definition(logits: list[float], threshold: float) -> None:
    probs = softmax(logits)
    always = torch.Generator().manual_seed(0)
    out = xtc(torch.tensor(probs, dtype=torch.float64), threshold, 1.0, always)
    assert {i for i, q in enumerate(out.tolist()) if q > 0} == ref_xtc(probs, threshold)


def test_xtc_fixed() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    always = torch.Generator().manual_seed(0)
    assert xtc(probs, 0.2, 1.0, always).tolist() == [0.0, 0.0, 0.2, 0.1]
    assert xtc(probs, 0.6, 1.0, always).tolist() == probs.tolist()  # > 0.5: off
    assert xtc(probs, 0.2, 0.0, always).tolist() == probs.tolist()  # never


TOKENS = st.lists(st.integers(0, 5), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    TOKENS,
    st.integers(0, 4),
    st.floats(min_value=1.0, max_value=3.0),
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), max_size=3),
)
def test_dry_matches_definition(
    tokens: list[int], allowed: int, base: float, breakers: list[tuple[int, ...]]
) -> None:
    dry = Dry(0.8, base, allowed, -1, breakers, tokens)
    expected = ref_dry(tokens, 0.8, base, allowed, breakers)
    got = dry.penalties()
    assert got.keys() == expected.keys()
    for token, value in expected.items():
        assert got[token] == pytest.approx(value)


def test_dry_fixed() -> None:
    # a b c c b c y a b c: the run "a b c" repeats, so the token after it, c, is penalised
    # for a run of 3 (llama.cpp's own example); "b c" precedes y too (run 2).
    a, b, c, y = 1, 2, 3, 4
    dry = Dry(1.0, 2.0, 2, -1, [], [a, b, c, c, b, c, y, a, b, c])
    assert dry.penalties() == {c: 2.0, y: 1.0}
    breaking = Dry(1.0, 2.0, 2, -1, [(b,)], [a, b, c, c, b, c, y, a, b, c])
    assert breaking.penalties() == {}  # the last b ends every run: nothing repeats far enough
    windowed = Dry(1.0, 2.0, 2, 4, [], [a, b, c, c, b, c, y, a, b, c])
    assert windowed.penalties() == {}  # only "y a b c" is looked at


def test_dry_history_follows_accepted_tokens() -> None:
    dry = Dry(1.0, 2.0, 1, -1, [], [7, 8])
    dry.accept(7)
    assert dry.penalties() == {8: 1.0}
    logits = dry.apply(torch.zeros(10))
    assert logits[8] == -1.0 and logits.sum() == -1.0


def test_breakers_become_token_sequences() -> None:
    texts = ["a", "\n", "x\n", "ab", ":", "b"]
    encode = {"b": [5]}.__getitem__
    sequences = breaker_sequences(["\n", "ab"], texts, encode)
    # a token holding "\n" is a breaker alone; "a" ends with the beginning of "ab", whose
    # rest "b" is token 5; "ab" itself holds it
    assert set(sequences) == {(1,), (2,), (0, 5), (3,)}


def test_mirostat_2_truncates_by_mu_and_tracks_tau() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    state = Mirostat(2, tau=1.0, eta=0.5, vocab_size=4)  # mu 2: surprise <= 2 bits: 3 tokens? no
    # surprises 1, 2, 3, 3 bits: with mu = 2 the first with surprise > 2 is index 2
    token = state.draw(probs, torch.Generator().manual_seed(0))
    assert token in (0, 1)
    kept = {0: 0.5 / 0.75, 1: 0.25 / 0.75}[token]
    assert state.mu == pytest.approx(2.0 - 0.5 * (-math.log2(kept) - 1.0))


def test_mirostat_1_estimates_k() -> None:
    # Zipf probabilities with s = 1.2: the estimate recovers s, and k follows the formula.
    ranks = torch.arange(1, 201, dtype=torch.float64)
    probs = ranks**-1.2
    probs /= probs.sum()
    state = Mirostat(1, tau=3.0, eta=0.1, vocab_size=200)
    epsilon = 0.2
    k = ((epsilon * 2**6.0) / (1 - 200**-epsilon)) ** (1 / 1.2)
    assert state._top_k(probs) == int(k)


def test_held_back_never_leaves_nothing() -> None:
    logits = torch.tensor([0.0, 1.0, float("-inf")])
    assert held_back(logits, [1]).tolist() == [0.0, float("-inf"), float("-inf")]
    only_end = torch.tensor([float("-inf"), 1.0, float("-inf")])
    assert held_back(only_end, [1]).tolist() == only_end.tolist()


# -- through the request sampler --------------------------------------------------------------


def test_min_tokens_holds_the_end_back() -> None:
    end = 3
    params = SamplingParams(temperature=0.0, min_tokens=2, min_tokens_ids=(end,), max_new_tokens=5)
    sampler = RequestSampler(params, 4)
    favours_end = torch.tensor([[0.0, 1.0, 0.0, 9.0]])
    assert sample_batch(favours_end, [sampler]) == [1]
    assert sample_batch(favours_end, [sampler]) == [1]
    assert sample_batch(favours_end, [sampler]) == [end]  # two tokens made: the end may come


def test_greedy_request_still_takes_dry() -> None:
    params = SamplingParams(temperature=0.0, dry_multiplier=5.0, dry_allowed_length=1)
    sampler = RequestSampler(params, 4, prompt=[1, 2, 1])
    # 2 would extend the run "1 2" after the final 1; DRY pushes it below 0
    assert sample_batch(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), [sampler]) == [0]


PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 5]),
    typical_p=st.sampled_from([1.0, 0.6]),
    top_n_sigma=st.sampled_from([-1.0, 1.5]),
    xtc_probability=st.sampled_from([0.0, 0.5]),
    xtc_threshold=st.sampled_from([0.05, 0.2]),
    dry_multiplier=st.sampled_from([0.0, 0.8]),
    dry_allowed_length=st.sampled_from([1, 2]),
    dry_breakers=st.sampled_from([(), ((3,),)]),
    mirostat=st.sampled_from([0, 1, 2]),
    min_tokens=st.sampled_from([0, 3]),
    min_tokens_ids=st.just((0,)),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=4), st.integers(0, 2**16))
def test_tokens_do_not_depend_on_the_batch(params: list[SamplingParams], seed: int) -> None:
    """Each request's tokens, alone, equal its tokens batched with the others (which may be
    greedy or sample with other samplers), over steps whose logits depend on the step."""
    vocab, steps = 24, 12
    rng = random.Random(seed)
    rows = [[[rng.gauss(0, 3) for _ in range(vocab)] for _ in params] for _ in range(steps)]
    prompt = [rng.randrange(vocab) for _ in range(6)]

    def run(chosen: list[int]) -> list[list[int]]:
        samplers = [RequestSampler(params[i], vocab, prompt) for i in chosen]
        out: list[list[int]] = [[] for _ in chosen]
        for step in range(steps):
            logits = torch.tensor([rows[step][i] for i in chosen])
            for slot, token in enumerate(sample_batch(logits, samplers)):
                out[slot].append(token)
        return out

    together = run(list(range(len(params))))
    for index in range(len(params)):
        assert run([index]) == [together[index]]
