"""The n-gram drafter against a plain reading of prompt lookup, the draft length's
adaptation, and where the engine refuses to speculate (with the reason logged)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.speculate import DraftLength, NgramDrafter


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


def test_the_draft_length_follows_acceptance() -> None:
    length = DraftLength(limit=8)
    assert length.next() == 8
    length.observe(8, 3)  # shrinks to what was accepted, plus one
    assert length.next() == 4
    length.observe(4, 4)  # accepted whole: doubles, up to the limit
    assert length.next() == 8
    length.observe(8, 0)  # a miss: one step without a draft, then a draft of one
    assert length.next() == 0 and length.next() == 1
    length.observe(1, 0)  # a second miss in a row: two steps without
    assert [length.next() for _ in range(3)] == [0, 0, 1]
    length.observe(1, 1)
    assert length.next() == 2 and length.misses == 0


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
    with pytest.raises(ValueError, match="speculate='draft'"):
        ss.EngineConfig(speculate="draft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculate_max_draft=0"):
        ss.EngineConfig(speculate_max_draft=0)
