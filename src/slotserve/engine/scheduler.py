"""`Scheduler`: which running requests advance in the next step, and by how much.

Pure policy over `Request` objects: it never touches tensors or the KV pool.
"""

from __future__ import annotations

from collections import deque

from slotserve.engine.config import EngineConfig
from slotserve.engine.events import PRIORITIES, Priority
from slotserve.engine.request import Request

SHARE_WINDOW = 50  # steps over which background's minimum share is measured


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._recent_classes: deque[Priority] = deque(maxlen=SHARE_WINDOW)

    def pick_class(self, ready: list[Request]) -> Priority | None:
        """isolate: the highest class with ready work, except that background takes a
        step when its share of recent steps fell below ``background_min_share``."""
        classes = {r.priority for r in ready}
        if not classes:
            return None
        share = self.config.background_min_share
        if "background" in classes and share > 0 and len(classes) > 1:
            recent = self._recent_classes
            taken = sum(c == "background" for c in recent) / max(len(recent), 1)
            if taken < share:
                return "background"
        return next(c for c in PRIORITIES if c in classes)

    def select(self, running: list[Request], max_batch: int) -> list[tuple[Request, int]]:
        """The step: each chosen request with the number of tokens it feeds.

        Decodes (one token each) are taken first so that running streams keep their pace;
        prefill chunks fill what is left of ``max_batch_tokens``.
        """
        ready = [r for r in running if r.state == "running" and not r.cancelled.is_set()]
        # Least recently stepped first, so that a batch cap (pressure) rotates over sessions.
        ready.sort(key=lambda r: r.last_step)
        if self.config.policy == "isolate":
            chosen = self.pick_class(ready)
            ready = [r for r in ready if r.priority == chosen]
        decodes = [r for r in ready if not r.in_prefill][:max_batch]
        work = [(r, 1) for r in decodes]
        budget = self.config.max_batch_tokens - len(work)
        for request in (r for r in ready if r.in_prefill):
            if len(work) >= max_batch or budget <= 0:
                break
            chunk = min(self.config.prefill_chunk, len(request.prompt) - request.prefilled, budget)
            work.append((request, chunk))
            budget -= chunk
        if work:
            self._recent_classes.append(work[0][0].priority)
        return work
