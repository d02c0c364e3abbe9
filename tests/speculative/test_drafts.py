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
