"""`ModelSet`: the models one process serves, under one memory budget.

A set names each model (`ModelSpec`): a *resident* model is loaded at start and stays; an
*on-demand* one is loaded when a request names it and unloaded when another load needs its
room (least recently used first, never one with requests in flight) or when it has been
idle ``keep_alive_s``. How a model is loaded is the caller's (``load``: a spec to a
`Loaded` — an engine, its kind, and its plan's bytes); the set decides *whether* and
*when*.

The device plan. The budget holds the process's shared arenas (``shared_bytes``: the
runtime before any model, the server's grammars and stored responses) plus each loaded
model's plan (its own ledger's arenas, KV and activations: `Loaded.plan_bytes`) plus, while
a load runs, that model's reservation. Every model is planned once at `start` (an on-demand
one is loaded, measured and unloaded), so a later load is admitted on its measured plan: it
runs only if the room is there after unloading idle on-demand models, else the request is
refused at once (`AdmissionRefused` ``model_capacity``), before anything is allocated. A
load that fails leaves nothing behind: the reservation is dropped and the model is
unloaded. The per-model arenas are reported as ``NAME.ARENA`` (`arenas`).

Owns: the models' states (``loaded``, ``loading``, ``unloaded``), their leases (requests
between naming a model and submitting to it), the reservation of a load, the LRU order.
Must not touch: an engine's internals (it reads `Loaded.busy`) or how a step is scheduled
(`slotserve.engine.device`). Locking: one condition guards the states; a load runs outside
it (other models keep serving), announced by the ``loading`` state.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from slotserve.errors import AdmissionRefused, PlanError
from slotserve.memory import MemoryLedger, format_bytes, trim_heap

log = logging.getLogger("slotserve")

ModelKind = Literal["generate", "embed"]
ModelState = Literal["loaded", "loading", "unloaded"]
MODEL_STATES: tuple[ModelState, ...] = ("loaded", "loading", "unloaded")
# How often the keep-alive sweep looks for idle on-demand models past their keep_alive_s.
SWEEP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ModelSpec:
    """One served model: ``name`` (what requests send), ``source`` (``bundled``, a named
    model, a file or directory), ``resident`` (loaded at start and kept) or on demand,
    ``keep_alive_s`` (on demand: unloaded after this many idle seconds; None: only when
    room is needed), and ``settings`` (the engine settings of this model alone: max_seqs,
    max_context, kv_layout, kv_dtype, prefix_cache, preset …; the loader reads them)."""

    name: str
    source: str
    resident: bool = True
    keep_alive_s: float | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or "=" in self.name:
            raise ValueError(
                f"model name {self.name!r}: give a non-empty name without spaces or '='"
            )
        if not self.source:
            raise ValueError(f"model {self.name!r}: give its source (bundled, a file, a dir)")
        if self.keep_alive_s is not None and self.keep_alive_s <= 0:
            raise ValueError(
                f"model {self.name!r}: keep_alive={self.keep_alive_s} must be > 0 seconds"
            )
        if self.resident and self.keep_alive_s is not None:
            raise ValueError(
                f"model {self.name!r}: keep_alive applies to on-demand models; set "
                "resident = false or drop keep_alive"
            )


@dataclass
class Loaded:
    """What a load produced: the ``engine`` serving the model (an `Engine`, or an encoder
    engine), its ``kind``, its plan's bytes (``plan_bytes``: its arenas, KV and
    activations, or its load's transient peak where higher; ``arenas``: by name), ``busy``
    (whether the engine holds or queues a request), ``close`` (what unloading runs) and the
    ``grammar_compiler`` whose index its plan counts (None: none) and its
    ``sampling_defaults`` (a server's, from the model's generation config)."""

    engine: Any
    kind: ModelKind
    plan_bytes: int
    arenas: Mapping[str, int]
    busy: Callable[[], bool]
    close: Callable[[], None]
    grammar_compiler: Any = None
    sampling_defaults: Any = None  # the server's defaults for fields a request leaves out


@dataclass
class _Entry:
    spec: ModelSpec
    state: ModelState = "unloaded"
    loaded: Loaded | None = None
    planned_bytes: int = 0  # measured at start; a load is admitted on it
    kind: ModelKind = "generate"
    leases: int = 0
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    progress: str = ""


class ModelSet:
    """The served models (module docstring). ``load(spec)`` builds a model's `Loaded`;
    ``budget``: the device's bytes (None: no budget, nothing is ever refused for room);
    ``ledger``: the device's, the process's arenas outside every model (the server's start
    adds to it); or, without one, ``shared_bytes()`` (and ``shared_arenas()`` by name)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        load: Callable[[ModelSpec], Loaded],
        *,
        budget: int | None,
        ledger: MemoryLedger | None = None,
        shared_bytes: Callable[[], int] = lambda: 0,
        shared_arenas: Callable[[], dict[str, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [s.name for s in specs]
        if not specs:
            raise ValueError("a model set needs at least one model")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"model names must be unique; {twice} given twice")
        if ledger is not None:
            shared_bytes, shared_arenas = (lambda: ledger.total), ledger.arenas
        self._load, self.budget, self._shared, self.clock = load, budget, shared_bytes, clock
        self._shared_arenas = shared_arenas or (lambda: {"shared": shared_bytes()})
        self.ledger = ledger
        self._entries = {s.name: _Entry(s) for s in specs}
        self._cond = threading.Condition()
        self._reserved = 0  # the plan of the load under way (one at a time)
        self._closed = False
        self._sweeper: threading.Thread | None = None

    # -- start and close ---------------------------------------------------------------

    def start(self, *, check: bool = True) -> None:
        """Plan every model: load each (residents first) and keep the residents; an
        on-demand model is measured, then unloaded. With ``check``, `PlanError` (nothing
        left loaded) naming each model's bytes and the levers when the residents and the
        largest on-demand model do not fit (`problems`)."""
        try:
            order = sorted(self._entries.values(), key=lambda e: not e.spec.resident)
            for entry in order:
                loaded = self._load_now(entry)
                entry.planned_bytes, entry.kind = loaded.plan_bytes, loaded.kind
                if entry.spec.resident:
                    self._commit(entry, loaded)
                else:
                    self._discard(loaded)
                if check:
                    self.check()
        except BaseException:
            self.close()
            raise
        if any(e.spec.keep_alive_s is not None for e in self._entries.values()):
            self._sweeper = threading.Thread(
                target=self._sweep, name="slotserve-keep-alive", daemon=True
            )
            self._sweeper.start()

    def check(self) -> None:
        """`PlanError` naming each model's bytes and the levers when the models planned so
        far do not fit the budget (`problems`)."""
        problems = self.problems()
        if problems:
            raise PlanError(problems[0])

    def problems(self) -> list[str]:
        """Why the models planned so far do not fit the budget (`required_bytes`), with
        each model's bytes and the levers; empty when they fit or there is no budget."""
        need = self.required_bytes
        if self.budget is None or need <= self.budget:
            return []
        with self._cond:
            entries = [e for e in self._entries.values() if e.planned_bytes]
        rows = "; ".join(
            f"{e.spec.name} ({'resident' if e.spec.resident else 'on demand'}) "
            f"{format_bytes(e.planned_bytes)}"
            for e in sorted(entries, key=lambda e: not e.spec.resident)
        )
        on_demand = any(not e.spec.resident for e in entries)
        return [
            f"the models do not fit the budget {format_bytes(self.budget)}: they need "
            f"{format_bytes(need)} (shared arenas {format_bytes(self._shared())}; {rows}"
            f"{'; the largest on-demand model counted once' if on_demand else ''}). Levers "
            "per model: lower its max_seqs or max_context, a smaller kv_dtype (int8), "
            "resident = false, or drop it; or raise --memory-budget"
        ]

    def close(self) -> None:
        """Unload every model (each engine closed: its requests cancelled)."""
        with self._cond:
            self._closed = True
            entries = [e for e in self._entries.values() if e.loaded is not None]
            loaded = [e.loaded for e in entries]
            for entry in entries:
                entry.loaded, entry.state = None, "unloaded"
            self._cond.notify_all()
        for each in loaded:
            if each is not None:
                self._discard(each)

    # -- requests ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def knows(self, name: str) -> bool:
        return name in self._entries

    @contextmanager
    def lease(self, name: str) -> Iterator[Any]:
        """The engine of model ``name`` for one request, loaded first when it is not
        (blocking); held until the request is submitted, so the model is not unloaded in
        between. `AdmissionRefused` ``model_capacity`` when the load cannot have its room,
        ``closed`` when the set is closing; `KeyError` for an unknown name."""
        engine = self.acquire(name)
        try:
            yield engine
        finally:
            self.release(name)

    def acquire(self, name: str) -> Any:
        """Take a lease on model ``name`` (see `lease`) and return its engine."""
        entry = self._entries[name]
        with self._cond:
            while True:
                if self._closed:
                    raise AdmissionRefused("closed", "the server is shutting down")
                if entry.state == "loaded":
                    assert entry.loaded is not None
                    entry.leases += 1
                    entry.last_used = self.clock()
                    return entry.loaded.engine
                if entry.state == "unloaded" and self._reserved == 0:
                    break  # this thread loads it
                self._cond.wait()  # its load (or another model's) is under way
            victims = self._room_for(entry)
            for victim in victims:
                self._unload_locked(victim)
            entry.state, self._reserved = "loading", entry.planned_bytes
            entry.progress = "loading"
            detached = [v.loaded for v in victims]
            for victim in victims:
                victim.loaded = None
        for each in detached:
            if each is not None:
                self._discard(each)
        try:
            loaded = self._load_now(entry)
        except BaseException:
            with self._cond:
                entry.state, self._reserved, entry.progress = "unloaded", 0, "load failed"
                self._cond.notify_all()
            gc.collect()
            trim_heap()
            raise
        with self._cond:
            self._reserved = 0
            if self._closed:  # the server shut down during the load: nothing stays
                entry.state = "unloaded"
                self._cond.notify_all()
        if self._closed:
            self._discard(loaded)
            raise AdmissionRefused("closed", "the server is shutting down")
        with self._cond:
            entry.planned_bytes = max(entry.planned_bytes, loaded.plan_bytes)
            self._commit(entry, loaded)
            entry.leases += 1
            entry.last_used = self.clock()
            self._cond.notify_all()
            return loaded.engine

    def release(self, name: str) -> None:
        """End a lease (`acquire`)."""
        entry = self._entries[name]
        with self._cond:
            assert entry.leases > 0, f"model {name!r} released more leases than it gave"
            entry.leases -= 1
            entry.last_used = self.clock()
            self._cond.notify_all()

    def _room_for(self, entry: _Entry) -> list[_Entry]:
        """Under the lock: the idle on-demand models to unload (least recently used first)
        so that ``entry``'s plan fits; `AdmissionRefused` ``model_capacity`` (nothing
        unloaded) when even all of them would not make room."""
        if self.budget is None:
            return []
        free = self.budget - self._used_locked()
        idle = sorted(
            (e for e in self._entries.values() if self._unloadable(e)),
            key=lambda e: e.last_used,
        )
        victims: list[_Entry] = []
        for victim in idle:
            if free >= entry.planned_bytes:
                break
            victims.append(victim)
            free += victim.planned_bytes
        if free >= entry.planned_bytes:
            return victims
        busy = [
            e.spec.name for e in self._entries.values()
            if e.state == "loaded" and not self._unloadable(e)
        ]  # fmt: skip
        raise AdmissionRefused(
            "model_capacity",
            f"model {entry.spec.name!r} needs {format_bytes(entry.planned_bytes)} and the "
            f"budget {format_bytes(self.budget)} has {format_bytes(free)} free after "
            f"unloading every idle on-demand model (held by {', '.join(busy) or 'nothing'}); "
            "retry when their requests finish, or raise --memory-budget",
        )

    def _unloadable(self, entry: _Entry) -> bool:
        return (
            entry.state == "loaded"
            and not entry.spec.resident
            and entry.leases == 0
            and entry.loaded is not None
            and not entry.loaded.busy()
        )

    def _unload_locked(self, entry: _Entry) -> None:
        log.info("unloading model %s (idle, room needed)", entry.spec.name)
        entry.state, entry.progress = "unloaded", "unloaded"
        entry.unloads += 1

    # -- loading -------------------------------------------------------------------------

    def _load_now(self, entry: _Entry) -> Loaded:
        name = entry.spec.name
        log.info("loading model %s from %s", name, entry.spec.source)
        began = time.perf_counter()
        loaded = self._load(entry.spec)
        log.info(
            "loaded model %s in %.1f s (%s planned)",
            name, time.perf_counter() - began, format_bytes(loaded.plan_bytes),
        )  # fmt: skip
        return loaded

    def _commit(self, entry: _Entry, loaded: Loaded) -> None:
        entry.loaded, entry.state, entry.kind = loaded, "loaded", loaded.kind
        entry.loads += 1
        entry.progress = "loaded"

    @staticmethod
    def _discard(loaded: Loaded) -> None:
        """Close an unloaded model's engine and give its memory back."""
        loaded.close()
        del loaded
        gc.collect()
        trim_heap()

    def _sweep(self) -> None:
        """Unload on-demand models idle past their keep_alive_s (a daemon thread)."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self.clock()
                expired = [
                    e for e in self._entries.values()
                    if self._unloadable(e) and e.spec.keep_alive_s is not None
                    and now - e.last_used >= e.spec.keep_alive_s
                ]  # fmt: skip
                detached = []
                for entry in expired:
                    log.info("unloading model %s (idle past keep_alive)", entry.spec.name)
                    entry.state, entry.progress = "unloaded", "unloaded (keep_alive)"
                    entry.unloads += 1
                    detached.append(entry.loaded)
                    entry.loaded = None
                self._cond.notify_all()
            for each in detached:
                if each is not None:
                    self._discard(each)
            time.sleep(SWEEP_INTERVAL_S)

    # -- views ---------------------------------------------------------------------------

    def _used_locked(self) -> int:
        models = sum(e.planned_bytes for e in self._entries.values() if e.state == "loaded")
        return self._shared() + models + self._reserved

    @property
    def shared_bytes(self) -> int:
        """The process's arenas outside every model (the device ledger's)."""
        return self._shared()

    @property
    def required_bytes(self) -> int:
        """What the budget must hold at worst: the shared arenas, every resident model's
        plan and the largest on-demand model's (one is loaded at a time at worst, when the
        budget holds no more)."""
        with self._cond:
            plans = [(e.spec.resident, e.planned_bytes) for e in self._entries.values()]
        largest = max((b for resident, b in plans if not resident), default=0)
        return self._shared() + sum(b for resident, b in plans if resident) + largest

    @property
    def used_bytes(self) -> int:
        """What the device plan holds now: the shared arenas, every loaded model's plan
        and the load under way's reservation."""
        with self._cond:
            return self._used_locked()

    def engine(self, name: str) -> Any | None:
        """Model ``name``'s engine when loaded (no lease: for views), else None."""
        entry = self._entries[name]
        with self._cond:
            return entry.loaded.engine if entry.loaded is not None else None

    def loaded(self, name: str) -> Loaded | None:
        """Model ``name``'s `Loaded` when loaded (no lease: for views), else None."""
        entry = self._entries[name]
        with self._cond:
            return entry.loaded

    def grammar_compiler(self, name: str) -> Any:
        """The grammar compiler model ``name``'s load prepared (None: none, or unloaded)."""
        loaded = self.loaded(name)
        return loaded.grammar_compiler if loaded is not None else None

    def arenas(self) -> dict[str, int]:
        """The device plan by arena: the shared ones as named, then the loaded models'
        arenas, each named ``MODEL.ARENA``."""
        with self._cond:
            loaded = [(e.spec.name, e.loaded) for e in self._entries.values() if e.loaded]
        return self._shared_arenas() | {
            f"{name}.{arena}": nbytes
            for name, each in loaded
            if each is not None
            for arena, nbytes in each.arenas.items()
        }

    def cards(self) -> list[dict[str, Any]]:
        """Each model's state, kind, planned bytes, leases, whether its engine holds or
        queues a request (``busy``) and its load counts."""
        with self._cond:
            return [
                {
                    "id": e.spec.name,
                    "source": e.spec.source,
                    "state": e.state,
                    "kind": e.kind,
                    "resident": e.spec.resident,
                    "bytes": e.planned_bytes,
                    "leases": e.leases,
                    "busy": e.loaded is not None and e.loaded.busy(),
                    "loads": e.loads,
                    "unloads": e.unloads,
                    "progress": e.progress,
                }
                for e in self._entries.values()
            ]

    def check_integrity(self) -> None:
        """States agree with what is held; one load at a time; the plan holds the budget;
        no lease on an unloaded model."""
        with self._cond:
            loading = [e for e in self._entries.values() if e.state == "loading"]
            assert len(loading) <= 1, f"{len(loading)} loads at once"
            assert (self._reserved > 0) <= bool(loading), "a reservation with no load"
            for entry in self._entries.values():
                assert entry.state in MODEL_STATES, entry.state
                assert (entry.loaded is not None) == (entry.state == "loaded"), entry.spec.name
                assert entry.leases >= 0
                if entry.state != "loaded":
                    assert entry.leases == 0, f"{entry.spec.name} leased while {entry.state}"
            if self.budget is not None and not self._closed:
                used = self._used_locked()
                assert used <= self.budget, f"plan {used} over the budget {self.budget}"
