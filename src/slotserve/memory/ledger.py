"""The memory ledger: the one list of what the process holds, arena by arena, against one
budget.

Every part that holds memory adds its arena once, where it comes to hold it, saying how the
bytes are known (``measured``: the anonymous growth a `Meter` read across the work;
``computed``: from sizes alone; ``reserved``: set aside for a measurement that comes later)
and who added it (``source``). Nothing is ever replaced or removed: a later addition to the
same arena is another entry, and the arena is their sum, or its reserve where that is larger
(what is measured into a reserve fills it before it adds to the arena).
Who adds what (docs/ARCHITECTURE.md, "The memory ledger"):

- ``runtime``: the process before the first model (`slotserve.load`), the first step's
  one-time state (`slotserve.engine.probe`);
- ``start``: what a server's start leaves once its engine is sized (the largest step's
  one-time state, the HTTP stack's start), reserved by the command before it sizes the
  engine (`START_RESERVE`) and measured into that reserve;
- ``tokenizer``, ``weights``: the load, measured (or, where the budget covers the model
  alone, computed from the weights' sizes by the engine);
- ``methods``: a bundle's program, its planned arenas or what its largest step kept;
- ``grammar_index``, ``grammar_workers``, ``grammars``: the server's grammar compiler (its
  tokenizer index, its compile worker processes, the grammars it keeps);
- ``responses``: the Responses API's stored responses (their byte budget);
- ``draft_weights``, ``draft_kv``, ``draft_activations``: a draft model's (speculative
  decoding, `slotserve.engine.draft`), computed by the engine that drafts with it;
- ``kv`` and ``activations`` are computed from an engine's config by its `CapacityPlan`,
  which adds them to the ledger's arenas when it checks a budget.

A *peak* is transient memory a budget must also hold (a load's copies): not an arena, since
it is gone when the work ends, but the budget must hold the larger of the arenas' sum and
every peak. A budget is a total or a `MemoryMap` (a limit per arena); a map that leaves out
an arena the ledger holds is refused naming it, never passed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from slotserve.errors import PlanError
from slotserve.memory.process import Reading, anonymous_peak_since, read_process, reset_peak
from slotserve.memory.units import format_bytes, parse_bytes

How = Literal["measured", "computed", "reserved"]
HOWS: tuple[How, ...] = ("measured", "computed", "reserved")


@dataclass(frozen=True)
class Arena:
    """One entry of the ledger: ``bytes`` of arena ``name``, ``how`` they are known, and
    the ``source`` that added them."""

    name: str
    bytes: int
    how: How
    source: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an arena needs a name")
        if self.bytes < 0:
            raise ValueError(f"arena {self.name!r}: {self.bytes} bytes must be >= 0")
        if self.how not in HOWS:
            raise ValueError(f"arena {self.name!r}: how={self.how!r} is not one of {HOWS}")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "bytes": self.bytes, "how": self.how, "source": self.source}


@dataclass(frozen=True)
class MemoryMap:
    """A budget per arena instead of one total: ``limits``, (arena, bytes) pairs. Every
    arena the plan holds needs a limit here."""

    limits: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.limits]
        if len(set(names)) != len(names):
            raise ValueError(f"the memory map names an arena twice: {names}")
        for name, limit in self.limits:
            if not name or limit < 0:
                raise ValueError(f"the memory map's {name!r}={limit} is not a limit")

    @classmethod
    def of(cls, **limits: int | str) -> MemoryMap:
        """``MemoryMap.of(weights="600MiB", kv=256 << 20, ...)``."""
        return cls(tuple((name, parse_bytes(limit)) for name, limit in limits.items()))

    @classmethod
    def parse(cls, text: str) -> MemoryMap:
        """``"runtime=300MiB,weights=100MiB,kv=64MiB,..."`` → a map (the CLI's
        ``--memory-map``)."""
        pairs = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, limit = part.partition("=")
            if not sep:
                raise ValueError(
                    f"--memory-map {text!r}: {part!r} is not ARENA=BYTES; write e.g. "
                    "runtime=300MiB,tokenizer=32MiB,weights=128MiB,kv=64MiB,activations=32MiB"
                )
            pairs.append((name.strip(), parse_bytes(limit)))
        return cls(tuple(pairs))

    def limit(self, name: str) -> int | None:
        return dict(self.limits).get(name)

    @property
    def total(self) -> int:
        return sum(limit for _, limit in self.limits)

    def __str__(self) -> str:
        return ",".join(f"{name}={format_bytes(limit)}" for name, limit in self.limits)


Budget = int | MemoryMap


def budget_problems(arenas: Mapping[str, int], peak: int, budget: Budget | None) -> list[str]:
    """Why ``arenas`` (and a transient ``peak``) do not fit ``budget``, one sentence a
    reason; empty when they fit (or there is no budget)."""
    if budget is None:
        return []
    total = sum(arenas.values())
    if isinstance(budget, int):
        if max(total, peak) <= budget:
            return []
        what = "the arenas" if total >= peak else "the peak"
        return [
            f"{what} need {format_bytes(max(total, peak))}, more than the budget "
            f"{format_bytes(budget)}"
        ]
    problems = []
    for name, used in arenas.items():
        limit = budget.limit(name)
        if limit is None:
            problems.append(
                f"the memory map has no limit for arena {name!r} ({format_bytes(used)}); "
                f"add {name}=BYTES to it"
            )
        elif used > limit:
            problems.append(
                f"arena {name!r} needs {format_bytes(used)}, more than its limit "
                f"{format_bytes(limit)} in the memory map"
            )
    if peak > budget.total:
        problems.append(
            f"the peak {format_bytes(peak)} is more than the memory map's total "
            f"{format_bytes(budget.total)}"
        )
    return problems


class MemoryLedger:
    """The process's arenas, appended as parts come to hold memory (module docstring).
    Thread-safe: a server's start and a grammar compile may add at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arenas: list[Arena] = []
        self._peaks: list[Arena] = []

    def add(self, name: str, nbytes: int, how: How, source: str) -> Arena:
        """Append ``nbytes`` to arena ``name``."""
        arena = Arena(name, nbytes, how, source)
        with self._lock:
            self._arenas.append(arena)
        return arena

    def add_peak(self, name: str, nbytes: int, source: str) -> Arena:
        """Record a transient peak the budget must hold (the process's whole anonymous
        bytes at it, not a growth): a load's copies, say."""
        peak = Arena(name, nbytes, "measured", source)
        with self._lock:
            self._peaks.append(peak)
        return peak

    def meter(self, source: str, *, peak: str | None = None) -> Meter:
        """A `Meter` whose marks add measured arenas from now on; with ``peak``, it also
        tracks the process's peak under that name (`Meter.close`)."""
        return Meter(self, source, peak)

    @contextmanager
    def measure(self, name: str, source: str) -> Iterator[Meter]:
        """``with ledger.measure("weights", "load"):`` adds the anonymous growth across the
        block as arena ``name``."""
        meter = self.meter(source)
        yield meter
        meter.mark(name)

    @property
    def entries(self) -> tuple[Arena, ...]:
        with self._lock:
            return tuple(self._arenas)

    @property
    def peaks(self) -> tuple[Arena, ...]:
        with self._lock:
            return tuple(self._peaks)

    def arenas(self) -> dict[str, int]:
        """Bytes by arena, in the order arenas first appeared: the sum of an arena's
        entries, or its reserve where that is larger."""
        return arena_totals(self.entries)

    def bytes(self, name: str) -> int:
        return self.arenas().get(name, 0)

    def has(self, name: str, source: str | None = None) -> bool:
        """Whether arena ``name`` has an entry (from ``source``, when given)."""
        return any(a.name == name and source in (None, a.source) for a in self.entries)

    @property
    def total(self) -> int:
        return sum(self.arenas().values())

    @property
    def peak_bytes(self) -> int:
        """The highest transient peak recorded (0: none)."""
        return max((p.bytes for p in self.peaks), default=0)

    def check(self, budget: Budget | None) -> None:
        """Raise `PlanError` unless the arenas and every peak fit ``budget`` (a map must
        name every arena)."""
        problems = budget_problems(self.arenas(), self.peak_bytes, budget)
        if problems:
            raise PlanError("; ".join(problems))

    def check_integrity(self) -> None:
        """Entries valid (`Arena`), and the sums agree with the entries."""
        entries = self.entries
        for arena in (*entries, *self.peaks):
            Arena(arena.name, arena.bytes, arena.how, arena.source)  # re-validates
        totals = self.arenas()
        for name, total in totals.items():
            own = [a for a in entries if a.name == name]
            held = sum(a.bytes for a in own if a.how != "reserved")
            reserve = sum(a.bytes for a in own if a.how == "reserved")
            assert total == max(held, reserve) >= held, (name, total, held, reserve)
        assert self.total == sum(totals.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "arenas": self.arenas(),
            "entries": [a.to_dict() for a in self.entries],
            "peaks": [p.to_dict() for p in self.peaks],
        }


def arena_totals(entries: Sequence[Arena]) -> dict[str, int]:
    """Bytes by arena name, in order of first appearance: each arena's measured and
    computed entries summed, or its reserved entries' sum where that is larger."""
    held: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for arena in entries:
        held.setdefault(arena.name, 0)
        if arena.how == "reserved":
            reserved[arena.name] = reserved.get(arena.name, 0) + arena.bytes
        else:
            held[arena.name] += arena.bytes
    return {name: max(nbytes, reserved.get(name, 0)) for name, nbytes in held.items()}


class Meter:
    """Reads the process's anonymous bytes from its creation on: each `mark` adds the growth
    since the last mark (or the start) as a measured arena; `close` records the peak it
    tracks, if any. The peak is the process's: it is reset when the meter starts
    (`reset_peak`), so one meter with a peak at a time."""

    def __init__(self, ledger: MemoryLedger, source: str, peak: str | None = None) -> None:
        self.ledger, self.source, self._peak = ledger, source, peak
        self._peak_tracked = peak is not None and reset_peak()
        self.start: Reading = read_process()
        self._last = self.start.anonymous

    def growth(self) -> int:
        """The anonymous growth since the last mark, not yet added."""
        return max(read_process().anonymous - self._last, 0)

    def mark(self, name: str, *, extra: int = 0, at_least: int = 0) -> Arena:
        """Add the growth since the last mark (plus ``extra`` bytes measured otherwise, such
        as file pages slotserve keeps mapped; at least ``at_least``) as arena ``name``."""
        now = read_process().anonymous
        grown = max(now - self._last, 0)
        self._last = now
        return self.ledger.add(name, max(grown + extra, at_least), "measured", self.source)

    def skip(self) -> None:
        """Leave the growth since the last mark out of every arena (the caller counts it
        elsewhere, or it is transient)."""
        self._last = read_process().anonymous

    def close(self) -> int:
        """Record the tracked peak (a bound on the anonymous bytes' peak since the start:
        `anonymous_peak_since`) and return it; 0 where no peak was tracked."""
        if not self._peak_tracked or self._peak is None:
            return 0
        peak = anonymous_peak_since(self.start)
        self.ledger.add_peak(self._peak, peak, self.source)
        return peak
