"""`StopMatcher`: stop strings over streamed text, never emitting any part of one.

Owns text only (no tokens, no logits); the engine feeds it each token's decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Streams text through, holding back any tail that could still become a stop string.

    ``push(text)`` returns the text that is safe to emit and whether a stop string has
    completed (text from the stop string on is dropped).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out, True
        keep = self._held_tail()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        """Text held back when generation ends for another reason."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
