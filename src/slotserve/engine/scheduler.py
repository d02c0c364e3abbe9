"""`Scheduler`: which running requests advance in the next step, and by how much.

Pure policy over `Request` objects: it never touches tensors or the KV pool. Under device
pressure (``under_pressure``, the engine's reading of its `PressureSource`) background
requests take no step: they stay bound, their KV kept, and go on where they stopped once
the pressure clears; the other classes go on, in batches of at most half the slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from slotserve.engine.config import EngineConfig
from slotserve.engine.events import PRIORITIES, Priority
from slotserve.engine.request import Request


class Classed(Protocol):
    """Work with a priority class (a `Request`, an encoder's embedding request)."""

    @property
    def priority(self) -> Priority: ...


def _never() -> bool:
    return False


class Scheduler:
    """The step policy of one engine: ``config``'s policy and shares, and the pressure
    signal ``under_pressure`` (read once a step; default: never under pressure)."""

    def __init__(
        self, config: EngineConfig, under_pressure: Callable[[], bool] | None = None
    ) -> None:
        self.config = config
        self.under_pressure = under_pressure or _never
        # Background's accrued claim on contended steps (deficit round robin): each step
        # where background waits behind another class adds ``background_min_share``; a
        # whole step's worth buys background the step. Steps background runs alone earn
        # nothing, so a fresh or idle scheduler never lets background jump the queue.
        self._background_credit = 0.0

    def pick_class(self, ready: Sequence[Classed]) -> Priority | None:
        """isolate: the highest class with ready work, except that background takes one
        step in every ``1 / background_min_share`` steps where it competes with another
        class, so it is never starved."""
        classes = {r.priority for r in ready}
        if not classes:
            return None
        best = next(c for c in PRIORITIES if c in classes)
        share = self.config.background_min_share
        if "background" in classes and best != "background" and share > 0:
            self._background_credit += share
            if self._background_credit >= 1.0 - 1e-9:  # 10 x 0.1 sums to 0.999…
                self._background_credit -= 1.0
                return "background"
        return best

    def select(self, running: list[Request], max_batch: int) -> list[tuple[Request, int]]:
        """The step: each chosen request with the number of tokens it feeds.

        Decodes (one token each) are taken first so that running streams keep their pace;
        prefill chunks fill what is left of ``max_batch_tokens``. Under pressure background
        requests are left out (paused, not released) and ``max_batch`` is halved.
        """
        ready = [r for r in running if r.state == "running" and not r.cancelled.is_set()]
        if self.under_pressure():
            ready = [r for r in ready if r.priority != "background"]
            max_batch = max(1, max_batch // 2)
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
        return work
