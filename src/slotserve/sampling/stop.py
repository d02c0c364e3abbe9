"""`StopMatcher`: stop strings over streamed text, never emitting any part of one.

Owns text only (no tokens, no logits); the engine feeds it each token's decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Streams text through, holding back any tail that could still become a stop string.

    ``push(text)`` (one token's text) returns the text that is safe to emit and whether a
    stop string has completed (text from the stop string on is dropped).

    ``min_tokens`` (vLLM's): no stop string ends the output before that many tokens; the
    text of the first ``min_tokens - 1`` tokens passes unchecked, and a stop string counts
    when it lies in the text from the ``min_tokens``-th token on. (vLLM also matches one
    that began earlier and cuts the text back to it; text already streamed cannot be taken
    back, so here it is not matched.)
    """

    def __init__(self, stops: Sequence[str], min_tokens: int = 0) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False
        self.unchecked = max(min_tokens - 1, 0)  # tokens whose text passes unchecked

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if self.unchecked > 0:
            self.unchecked -= 1
            return text, False
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
