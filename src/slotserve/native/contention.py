"""`ThreadGovernor`: the kernels' thread count follows how much of the cores a step gets.

The kernels' OpenMP threads spin between their parallel regions (about 150 a decode step),
which is what makes a step fast on cores of its own. When another process takes one of
those cores, every region's barrier waits for a descheduled thread for a time slice, and
a decode loop on all cores runs far slower than the same loop on one thread (figures:
docs/BENCHMARKS.md). A device shares its cores with other apps, so the runtime cannot
assume them.

The governor watches, over windows of stepping, the share of its threads' time the process
really ran (process CPU time over wall time times threads). Below `GovernorConfig.contended`
it drops the kernels to one thread. On one thread it tries all of them again after
`probe_s` of stepping, for one window, and keeps them if they got their cores; each failed
probe doubles the wait (up to `max_probe_s`), a kept one resets it. A step's results do not
depend on the thread count (the kernels' batch-invariance contract covers it), only its
speed does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

_log = logging.getLogger("slotserve")


class Threaded(Protocol):
    """A kernel whose calls run on ``threads`` threads (read at each call)."""

    threads: int


@dataclass(frozen=True)
class GovernorConfig:
    """``window_s``: stepping time a decision rests on; ``contended``: the share of its
    threads' time below which the cores count as taken; ``probe_s`` / ``max_probe_s``: the
    stepping time on one thread before trying all of them again (doubled after each failed
    try, up to the maximum)."""

    window_s: float = 0.25
    contended: float = 0.6
    probe_s: float = 2.0
    max_probe_s: float = 32.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s={self.window_s} must be > 0")
        if not 0 < self.contended < 1:
            raise ValueError(f"contended={self.contended} must be in (0, 1)")
        if not 0 < self.probe_s <= self.max_probe_s:
            raise ValueError(
                f"probe_s={self.probe_s} must be > 0 and at most max_probe_s={self.max_probe_s}"
            )


class ThreadGovernor:
    """Sets the ``threads`` of ``kernels`` (all to the same count) from `observe`'s steps:
    ``full`` threads while they get their cores, else one. Driven by one thread at a time
    (the engines of a process share one, `slotserve.engine.stepper`, and call `observe`
    under a lock); `threads`, `drops` and `probes` may be read from any."""

    def __init__(
        self, kernels: list[Threaded], full: int, config: GovernorConfig | None = None
    ) -> None:
        if full < 1:
            raise ValueError(f"full={full} threads must be >= 1")
        self.kernels, self.full = kernels, full
        self.config = config or GovernorConfig()
        self.threads = full
        self.drops = self.probes = 0  # times it went to one thread / tried all again
        self._wall = self._cpu = 0.0  # this window's
        self._on_one = 0.0  # stepping time on one thread since the last switch
        self._wait = self.config.probe_s
        self._probing = False
        self._set(full)

    def observe(self, wall_s: float, cpu_s: float) -> None:
        """One step took ``wall_s`` seconds, and the process ran ``cpu_s`` CPU seconds
        meanwhile (all its threads)."""
        if self.full == 1:
            return
        self._wall += wall_s
        self._cpu += cpu_s
        if self._wall < self.config.window_s:
            return
        share = self._cpu / (self._wall * self.threads)
        window, self._wall, self._cpu = self._wall, 0.0, 0.0
        if self.threads > 1:
            if share >= self.config.contended:
                if self._probing:  # the try got its cores: stay, and probe soon next time
                    self._probing, self._wait = False, self.config.probe_s
                    _log.info("kernels: the cores are free again: %d threads", self.threads)
                return
            if self._probing:
                self._wait = min(2 * self._wait, self.config.max_probe_s)
            else:
                self.drops += 1
                _log.info(
                    "kernels: %.0f%% of %d threads' time ran (another process holds the "
                    "cores): one thread until they are free",
                    100 * share,
                    self.threads,
                )
            self._probing, self._on_one = False, 0.0
            self._set(1)
            return
        self._on_one += window
        if self._on_one >= self._wait:
            self.probes += 1
            self._probing = True
            self._set(self.full)

    def _set(self, threads: int) -> None:
        self.threads = threads
        for kernel in self.kernels:
            kernel.threads = threads
