"""`StopMatcher` with ``min_tokens``: over random token texts and stop strings, it stops at
the first token after which a stop string lies whole in the text from the
``min_tokens``-th token's on, and emits the text up to the earliest such stop string (the
whole text when none ever does); with ``min_tokens`` 0 or 1 it is the plain matcher."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from slotserve.sampling import StopMatcher

PIECES = st.lists(st.text("ab\n", max_size=3), max_size=12)
STOPS = st.lists(st.text("ab\n", min_size=1, max_size=3), min_size=1, max_size=3)


def _expected(pieces: list[str], stops: list[str], min_tokens: int) -> tuple[str, bool]:
    """The definition, token by token: a stop string that a token completes (``a`` in
    ``"\\na"``) stops before one that begins earlier but a later token would complete
    (``"\\nab"``)."""
    start = len("".join(pieces[: max(min_tokens - 1, 0)]))
    for end in range(1, len(pieces) + 1):
        text = "".join(pieces[:end])
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return "".join(pieces), False


@settings(max_examples=300, deadline=None)
@example(pieces=["\na", "b"], stops=["a", "\nab"], min_tokens=0)
@given(pieces=PIECES, stops=STOPS, min_tokens=st.integers(0, 14))
def test_a_stop_string_counts_from_the_min_tokens_th_token(
    pieces: list[str], stops: list[str], min_tokens: int
) -> None:
    matcher = StopMatcher(stops, min_tokens)
    out, stopped = "", False
    for piece in pieces:
        emitted, stopped = matcher.push(piece)
        out += emitted
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert (out, stopped) == _expected(pieces, stops, min_tokens)
