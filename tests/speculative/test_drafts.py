"""The n-gram drafter against a plain reading of prompt lookup, the draft length's
adaptation, and where the engine refuses to speculate (with the reason logged)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.speculate import (
    PRIOR_ACCEPTANCE,
    Acceptance,
    NgramDrafter,
    Speculator,
    StepCost,
)


def lookup(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Prompt lookup by scanning: the longest n whose last n tokens occurred earlier; the
    tokens after the latest such earlier occurrence."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        tail = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):  # the earlier copy ends at `end`
            if tokens[end - n + 1 : end + 1] == tail:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 5), max_size=12), min_size=1, max_size=4),
    k=st.integers(0, 6),
)
def test_the_index_finds_what_a_scan_finds(chunks: list[list[int]], k: int) -> None:
    drafter = NgramDrafter()
    history: list[int] = []
    for chunk in chunks:  # extended piecewise, as a prompt then output tokens arrive
        drafter.extend(chunk)
        history += chunk
        assert drafter.propose(k) == lookup(history, k)


def test_a_repeated_phrase_is_drafted() -> None:
    drafter = NgramDrafter()
    drafter.extend([7, 1, 2, 3, 4, 5, 9, 1, 2])
    assert drafter.propose(3) == [3, 4, 5]
    assert drafter.propose(0) == []


def test_the_lookup_names_the_length_of_its_match() -> None:
    """A proposal following a 3-token match is a far likelier guess than one following a
    single token (in free-form chat most 1-token matches are wrong): the lookup says which
    it is, and the speculator keeps each length's acceptance apart."""
    drafter = NgramDrafter()
    drafter.extend([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert drafter.lookup(2) == (3, [4, 5])
    drafter.extend([8, 5])
    assert drafter.lookup(2) == (1, [9, 1])  # only "5" occurred before
    drafter.extend([6])
    assert drafter.lookup(2) == (0, [])


def test_the_acceptance_estimate_follows_the_drafts() -> None:
    acceptance = Acceptance()
    assert acceptance.rate == PRIOR_ACCEPTANCE
    for _ in range(10):
        acceptance.observe(6, 6)  # accepted whole: the estimate climbs towards 1
    assert acceptance.rate > 0.95
    assert acceptance.expected(3) == pytest.approx(sum(acceptance.rate**j for j in (1, 2, 3)))
    for _ in range(10):
        acceptance.observe(4, 0)  # rejected at once: it falls towards 0
    low = acceptance.rate
    assert low < 0.05
    acceptance.idle()  # not drafting: it drifts back towards the prior, slowly
    assert low < acceptance.rate < PRIOR_ACCEPTANCE


def test_the_step_cost_is_fitted_to_the_steps_run() -> None:
    cost = StepCost()
    for _ in range(5):
        cost.observe(1, 0.006)  # one size only: half of it is taken to be per row
    assert cost.line() == pytest.approx((0.003, 0.003))
    for rows in (1, 2, 5, 9) * 5:
        cost.observe(rows, 0.003 + 0.0025 * rows)
    fixed, per_row = cost.line()
    assert per_row == pytest.approx(0.0025, rel=0.1) and fixed == pytest.approx(0.003, rel=0.2)


def test_drafts_are_chosen_only_where_they_pay() -> None:
    """A likely draft on a step whose rows are cheap is verified at length; one that
    would cost more than it delivers (rows that each cost a whole step) is not."""
    cheap = Speculator("ngram", max_draft=8, max_step_tokens=64)
    for rows in (1, 2, 4, 8) * 5:
        cheap.observe_step(rows, 0.020 + 0.0005 * rows)  # weight-bound: rows nearly free
    dear = Speculator("ngram", max_draft=8, max_step_tokens=64)
    for rows in (1, 2, 4, 8) * 5:
        dear.observe_step(rows, 0.0001 + 0.005 * rows)  # row-bound: each row a step
    likely = Acceptance()
    likely.rate = 0.9
    assert len(cheap._choose([(0, likely, [1] * 8)], rows=1, delivered=1.0)[0]) >= 6
    assert dear._choose([(0, likely, [1] * 8)], rows=1, delivered=1.0) == {}


def likely(rate: float) -> Acceptance:
    acceptance = Acceptance()
    acceptance.rate = rate
    return acceptance


def test_steps_of_one_size_do_not_make_rows_free() -> None:
    """Eight streams decode in steps of 8 rows; then three end, and the 5-row steps that
    follow happen to take as long as the 8-row ones did (the machine's load moved). Fitted
    blindly, rows cost nothing, and 5 requests would each verify 8 drafted tokens in a
    45-row step; the fit leans on its prior where the sizes seen vary so little, prices
    rows past the largest step seen at no less than the prior's rate, and so drafts no
    further than the rows it has seen cost."""
    speculator = Speculator("ngram", max_draft=8, max_step_tokens=512)
    for step in range(50):
        speculator.observe_step(8, 0.024 + 0.001 * (step % 3))
    for _ in range(5):
        speculator.observe_step(5, 0.025)
    cost = speculator.cost
    assert cost.seconds(45) - cost.seconds(8) >= 37 * 0.5 * cost.seconds(8) / 8
    candidates = [(request, likely(0.8), [1] * 8) for request in range(5)]
    chosen = speculator._choose(candidates, rows=5, delivered=5.0)
    assert sum(len(tokens) for tokens in chosen.values()) <= 3  # up to the 8 rows seen


def test_one_slow_step_does_not_turn_the_fit() -> None:
    """Once the fit has settled, one step the OS descheduled (a 1-row step taking the time
    of 18) moves it no more than a step twice as slow as predicted would, so the draft
    chosen stays the length it was."""
    speculator = Speculator("ngram", max_draft=8, max_step_tokens=64)
    for rows in (1, 2, 4, 8) * 10:
        speculator.observe_step(rows, 0.002 + 0.0025 * rows)
    candidate = [(0, likely(0.9), [1] * 8)]
    before = speculator._choose(candidate, rows=1, delivered=1.0)
    speculator.observe_step(1, 0.045)
    assert speculator._choose(candidate, rows=1, delivered=1.0) == before


def test_each_thread_count_has_its_own_step_cost() -> None:
    """The thread governor runs the kernels on one thread while another process holds the
    cores, where a row costs another share of a step than on all of them. Steps on two
    threads (row-bound: each row nearly a step) and on one (rows nearly free), taking
    turns, are fitted apart: a likely draft is verified on one thread and not on two."""
    speculator = Speculator("ngram", max_draft=8, max_step_tokens=64)
    for rows in (1, 2, 4, 8) * 10:
        speculator.observe_step(rows, 0.0001 + 0.005 * rows, threads=2)
        speculator.observe_step(rows, 0.040 + 0.0005 * rows, threads=1)
    candidate = [(0, likely(0.9), [1] * 8)]
    speculator.cost.use(2)
    assert speculator._choose(candidate, rows=1, delivered=1.0) == {}
    speculator.cost.use(1)
    assert len(speculator._choose(candidate, rows=1, delivered=1.0)[0]) >= 6


def test_speculation_is_refused_where_logits_depend_on_the_chunking(
    bundled: ss.Model, caplog: pytest.LogCaptureFixture
) -> None:
    """fp32 weights run torch's own products, whose rounding may depend on the number of
    rows: drafts could change the output, so the engine does not draft, and says why."""
    with caplog.at_level(logging.INFO, logger="slotserve"):
        engine = ss.Engine(bundled, ss.EngineConfig(max_seqs=1, speculate="ngram"))
    try:
        assert engine.stats().speculation is None
        assert any("speculate=ngram refused" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_a_bad_setting_is_named() -> None:
    with pytest.raises(ValueError, match="speculate='medusa'"):
        ss.EngineConfig(speculate="medusa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculate_max_draft=0"):
        ss.EngineConfig(speculate_max_draft=0)
