"""Workload presets: the on-device serving table as `EngineConfig` overrides, sized to a budget.

A preset is one row of the table (``chat``, ``chat+background``, ``voice``,
``document-agent``, ``shared-prompt``): the `EngineConfig` fields its workload shape fixes
(layout, concurrency, policy, queue, sinks, and for ``voice`` the step cap that bounds a
cancel, `slotserve.engine.cancel_bound`), each with the reason, and for ``shared-prompt``
the share of the KV pool the prefix cache may pin. `choose_preset` applies a row to
`EngineConfig`'s own defaults (`dataclasses.replace`; nothing here repeats a default), then
the caller's overrides, and then sizes what the budget decides: ``max_context`` (and the
ring window of ``document-agent``) is the largest the engine's own `CapacityPlan`
(`EngineConfig.plan`) fits with the model's resident weight bytes, whatever format it
loaded (GGUF blocks, fp32, int8, a bundle's program), and the prefix cache gets its share of
the pool that plan sizes. `preset_config` is the config alone.

This module imports `EngineConfig`; `EngineConfig` never imports it. It never touches a
pool, a model's weights or a thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args

from slotserve.engine.config import EngineConfig
from slotserve.engine.prefix_share import with_parked_slots, with_prefix_cache_share
from slotserve.engine.probe import ledger_for
from slotserve.errors import PlanError
from slotserve.executor import executor_for
from slotserve.memory import MemoryLedger, MemoryMap, format_bytes, parse_bytes
from slotserve.model import Model
from slotserve.plan import CapacityPlan

PresetName = Literal["chat", "chat+background", "voice", "document-agent", "shared-prompt"]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)

# The smallest ring worth serving a document with: below it the window holds too little of
# the text for the model to follow it.
MIN_RING_WINDOW = 64

# The settings every preset decides (by its row, or by keeping EngineConfig's default), in
# the order `slotserve plan --preset` explains them; ``max_context``, ``ring_window`` and a
# row's prefix cache are sized to the budget.
TABLE_FIELDS = (
    "kv_layout",
    "kv_dtype",
    "max_seqs",
    "policy",
    "queue_depth",
    "queue_timeout_s",
    "background_min_share",
    "sinks",
    "max_batch_tokens",
)
SIZED_FIELDS = ("max_context", "ring_window", "prefix_cache_bytes")
_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class PresetRow:
    """One row of the on-device serving table: the `EngineConfig` fields it overrides.

    ``overrides`` may not name a sized field (``max_context``, ``ring_window``,
    ``prefix_cache_bytes``) nor the budget. ``prefix_cache_share`` in [0, 1) is the share of
    the planned KV pool the prefix cache may pin (0: off; cell layout only, whole blocks).
    ``reasons`` says, per field, why the row chooses it or keeps the engine's default
    (printed by ``slotserve plan --preset``).
    """

    name: PresetName
    shape: str
    admission: str
    overrides: Mapping[str, Any]
    reasons: Mapping[str, str] = field(default_factory=dict)
    prefix_cache_share: float = 0.0

    def __post_init__(self) -> None:
        fixed = set(SIZED_FIELDS) | {"memory_budget", "memory_map"}
        bad = sorted(set(self.overrides) - (_FIELDS - fixed))
        if bad:
            raise ValueError(
                f"preset {self.name}: {bad} cannot be a row's override; a row fixes only "
                f"EngineConfig fields other than {sorted(fixed)} (those are sized or given)"
            )
        unexplained = sorted(set(self.reasons) - _FIELDS)
        if unexplained:
            raise ValueError(f"preset {self.name}: reasons for {unexplained}, not fields")
        if not 0.0 <= self.prefix_cache_share < 1.0:
            raise ValueError(
                f"preset {self.name}: prefix_cache_share={self.prefix_cache_share} is not in [0, 1)"
            )
        config = dataclasses.replace(_DEFAULTS, **self.overrides)  # the values validate
        if self.prefix_cache_share and config.kv_layout != "cell":
            raise ValueError(
                f"preset {self.name}: prefix_cache_share={self.prefix_cache_share} pins whole "
                f"blocks and needs kv_layout='cell', not {config.kv_layout!r}"
            )
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))


PRESETS: Mapping[str, PresetRow] = MappingProxyType(
    {
        row.name: row
        for row in (
            PresetRow(
                name="chat",
                shape="one long-lived session, user watching",
                admission="concurrency 1, reserve the whole budget",
                overrides={"kv_layout": "flat", "max_seqs": 1, "queue_depth": 1},
                reasons={
                    "kv_layout": "one session owns one contiguous row; nothing to share",
                    "max_seqs": "concurrency 1: the one conversation gets the whole budget",
                    "policy": "one session: nothing to isolate, isolate kept as the safe default",
                    "queue_depth": "a turn sent while the previous one streams waits for it",
                },
            ),
            PresetRow(
                name="chat+background",
                shape="two classes, very different latency budgets",
                admission="priority classes, never co-batch across classes",
                overrides={
                    "kv_layout": "cell",
                    "max_seqs": 4,
                    "policy": "isolate",
                    "queue_depth": 8,
                    "queue_timeout_s": 120.0,
                },
                reasons={
                    "kv_layout": "shared blocks: a short chat turn and a long job each hold "
                    "only the blocks they reserve",
                    "max_seqs": "a chat turn beside up to three background jobs",
                    "policy": "never co-batch across classes; interactive steps first",
                    "queue_depth": "background jobs wait for a slot rather than fail",
                    "background_min_share": "background still advances while chat streams "
                    "(never starved), at a bounded cost to chat ITL",
                },
            ),
            PresetRow(
                name="voice",
                shape="short sessions, frequent cancellation (barge-in)",
                admission="admit eagerly, cancel aggressively",
                overrides={
                    "kv_layout": "cell",
                    "max_seqs": 4,
                    "policy": "isolate",
                    "queue_depth": 4,
                    "queue_timeout_s": 2.0,
                    "max_batch_tokens": 64,
                },
                reasons={
                    "kv_layout": "blocks return to the shared free list on every cancel "
                    "(strict teardown, checked by check_integrity)",
                    "max_seqs": "a few live turns: the one speaking and the ones barged in on",
                    "policy": "the spoken turn (interactive) steps first",
                    "queue_depth": "a barge-in's new turn waits only for the slot its "
                    "cancelled turn frees at the next step",
                    "queue_timeout_s": "a voice turn older than 2 s is stale: refuse it",
                    "max_batch_tokens": "a barge-in's cancel waits for at most the step in "
                    "flight: 64-token steps (not 512) bound the cancel→release time, at the "
                    "cost of a long prompt prefilled in more steps",
                },
            ),
            PresetRow(
                name="document-agent",
                shape="one session, context exceeds the window",
                admission="concurrency 1, accept window eviction",
                overrides={
                    "kv_layout": "ring",
                    "max_seqs": 1,
                    "queue_depth": 1,
                    "queue_timeout_s": 60.0,
                    "sinks": 4,
                },
                reasons={
                    "kv_layout": "a ring bounds the footprint absolutely; the oldest "
                    "positions leave the window",
                    "max_seqs": "concurrency 1: the one document gets the whole window",
                    "policy": "one session: isolate kept as the safe default",
                    "queue_depth": "a second document waits for the first",
                    "sinks": "the first positions stay attended forever (StreamingLLM sinks)",
                },
            ),
            PresetRow(
                name="shared-prompt",
                shape="shared prefix across many short requests",
                admission="admit in batches, cache the shared prefix",
                overrides={
                    "kv_layout": "cell",
                    "max_seqs": 8,
                    "policy": "fifo",
                    "queue_depth": 32,
                },
                prefix_cache_share=0.25,
                reasons={
                    "kv_layout": "blocks shared copy-on-write: what prefix reuse is built on",
                    "max_seqs": "many short requests step together",
                    "policy": "co-batch everything: throughput first, one class of work",
                    "queue_depth": "a burst waits and is admitted in batches as slots free",
                    "prefix_cache_bytes": "two sessions' worth at max_seqs=8 keeps the "
                    "shared prefix and its recent variants; its "
                    "snapshots hold only blocks no session uses and are evicted before a "
                    "request is refused, so the share costs no admission",
                },
            ),
        )
    }
)

# Why a row keeps EngineConfig's default, where the row does not say.
_DEFAULT_REASONS = {
    "kv_layout": "the engine's default layout",
    "kv_dtype": "the engine's default KV element: half fp32's bytes, and agreeing with "
    "llama.cpp (whose default it is too) on every tested family",
    "max_seqs": "the engine's default concurrency",
    "policy": "never co-batch classes; interactive first",
    "queue_depth": "the engine's default queue",
    "queue_timeout_s": "the longest a queued request waits before it is refused",
    "background_min_share": "background is never starved: it takes at least this share of "
    "steps when it competes",
    "sinks": "no attention sinks",
    "max_batch_tokens": "the engine's default step; a cancel waits for at most one step",
    "prefix_cache_bytes": "off: this workload shares no prefix worth pinning blocks for",
}


@dataclass(frozen=True)
class Decision:
    """One setting of a preset, its value, and why: the row chose it (``preset``), the
    engine's default was kept (``default``), the caller set it (``flag``), or the budget
    sized it (``sized``)."""

    setting: str
    value: Any
    why: str
    source: Literal["preset", "default", "flag", "sized"] = "preset"


@dataclass(frozen=True)
class PresetChoice:
    """What a preset chose for a model and a budget: the `EngineConfig` and the decisions
    behind it, one per setting."""

    row: PresetRow
    config: EngineConfig
    decisions: tuple[Decision, ...]

    def lines(self) -> list[str]:
        """One line per decision, each naming the table row (``slotserve plan --preset``)."""
        row, layout = self.row, self.config.kv_layout
        lines = [f"preset {row.name}: {row.shape} → {layout}, {row.admission}"]
        for d in self.decisions:
            lines.append(f"  [{row.name}] {d.setting} = {d.value}  ({d.source}: {d.why})")
        return lines


def preset_config(
    name: str,
    model: Model,
    memory_budget: int | str | None,
    *,
    ledger: MemoryLedger | None = None,
    **overrides: Any,
) -> EngineConfig:
    """The `EngineConfig` of preset ``name`` for ``model`` and ``memory_budget`` (see
    `choose_preset`, which also gives the reasons)."""
    return choose_preset(name, model, memory_budget, ledger=ledger, **overrides).config


def choose_preset(
    name: str,
    model: Model,
    memory_budget: int | str | None,
    *,
    ledger: MemoryLedger | None = None,
    **overrides: Any,
) -> PresetChoice:
    """Preset ``name`` (`PRESETS`) for a loaded model and a budget (bytes, ``"1GiB"``, or
    None: unbounded), sized against ``ledger``: every arena the process holds besides the
    engine's KV and activations, as the engine will plan them (`ledger_for`: the model's
    ledger and its probes, or the model's computed arenas with budget_scope="model"). A
    command passes the ledger it will start the engine with, its own arenas (the grammars)
    already added, so that what the preset sizes is what starts.

    ``overrides`` are `EngineConfig` fields the caller fixes; they replace the row's, and
    the sized settings are then computed around them (a ``memory_map`` replaces the
    budget). Raises `ValueError` for an unknown preset or field, and `PlanError` when the
    shape does not fit the budget at any context."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {', '.join(PRESET_NAMES)}")
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise ValueError(
            f"{unknown} are not EngineConfig fields; override any of {sorted(_FIELDS)}"
        )
    row = PRESETS[name]
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if overrides.get("memory_map") is not None:
        budget = None  # the plan takes a memory map or a total, not both
    sizer = _Sizer(row, model, overrides, budget, ledger)
    decisions = [_decision(row, key, getattr(sizer.config, key), overrides) for key in TABLE_FIELDS]
    decisions += [
        Decision(key, value, "set explicitly", "flag")
        for key, value in overrides.items()
        if key not in TABLE_FIELDS and key not in SIZED_FIELDS
    ]
    decisions += sizer.size()
    return PresetChoice(row, sizer.config, tuple(decisions))


def least_budget(
    name: str, model: Model, *, ledger: MemoryLedger | None = None, **overrides: Any
) -> int:
    """The smallest budget, in bytes, at which preset ``name`` fits ``model`` (sized as
    `choose_preset` sizes it against ``ledger``, with ``overrides``): one byte less and
    `choose_preset` raises `PlanError`. Every larger budget fits too (the sizer fills a
    budget, so what fits one fits any larger)."""

    def fits(budget: int) -> bool:
        try:
            choose_preset(name, model, budget, ledger=ledger, **overrides)
        except PlanError:
            return False
        return True

    low = ledger.total if ledger is not None else 0  # no budget under the arenas fits
    high = max(2 * low, 1 << 20)
    while not fits(high):
        low, high = high, 2 * high
        if high > 1 << 50:
            raise PlanError(f"preset {name} fits no budget (tried up to {format_bytes(high)})")
    while high - low > 1:  # low does not fit, high does
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _decision(row: PresetRow, key: str, value: Any, fixed: Mapping[str, Any]) -> Decision:
    if key in fixed:
        why = "set explicitly, overriding the row" if key in row.overrides else "set explicitly"
        return Decision(key, value, why, "flag")
    why = row.reasons.get(key) or _DEFAULT_REASONS[key]
    return Decision(key, value, why, "preset" if key in row.overrides else "default")


class _Sizer:
    """Sizes ``max_context``, the ring window and the prefix cache's share to the budget
    with the engine's own plan (`EngineConfig.plan`), replacing them in ``config``."""

    def __init__(
        self,
        row: PresetRow,
        model: Model,
        fixed: Mapping[str, Any],
        budget: int | None,
        ledger: MemoryLedger | None,
    ) -> None:
        self.row, self.model = row, model
        self.info, self.weight_bytes = model.info, model.weight_bytes
        self.fixed, self.budget = fixed, budget
        self.memory_map: MemoryMap | None = fixed.get("memory_map")
        settings = {**row.overrides, **fixed}
        layout = settings.get("kv_layout", _DEFAULTS.kv_layout)
        block_size = settings.get("block_size", _DEFAULTS.block_size)
        step = block_size if layout == "cell" else 1
        self.ceiling = self.info.max_context // step * step  # the model's, in whole blocks
        settings.setdefault("max_context", self.ceiling)
        self.config = dataclasses.replace(_DEFAULTS, memory_budget=budget, **settings)
        self.ledger = ledger_for(model, self.config, executor_for(model), ledger)
        self.attention_kernel = (
            self.config.kernels == "auto" and model.kernels.attention is not None
        )

    @property
    def bounded(self) -> bool:
        return self.budget is not None or self.memory_map is not None

    def plan(self, **kv: Any) -> CapacityPlan:
        """The engine's plan of the current config against the ledger, its KV shape
        changed by ``kv``."""
        plan = self.config.plan(self.info, self.ledger, attention_kernel=self.attention_kernel)
        return plan.with_kv(**kv) if kv else plan

    @property
    def limit(self) -> str:
        if self.memory_map is not None:
            return f"the memory map {self.memory_map}"
        assert self.budget is not None
        return f"the budget {format_bytes(self.budget)}"

    def replace(self, **changes: Any) -> None:
        self.config = dataclasses.replace(self.config, **changes)

    def size(self) -> list[Decision]:
        """Size the config's ``max_context``, ``ring_window`` and prefix cache; their
        decisions. Raises `PlanError` if the result does not fit."""
        if self.config.kv_layout == "ring":
            decisions = self._size_ring()
        else:
            decisions = [self._size_context()]
            decisions.append(self._given_or("ring_window", "not used (no ring layout)"))
        decisions.append(self._size_prefix_cache())
        if self.bounded:
            self.plan().check()  # explicit settings may still not fit: say which lever
        return decisions

    def _given_or(self, key: str, why: str) -> Decision:
        if key in self.fixed:
            return Decision(key, self.fixed[key], "set explicitly", "flag")
        return Decision(key, getattr(self.config, key), why, "default")

    def _size_context(self) -> Decision:
        if "max_context" in self.fixed:
            return Decision("max_context", self.config.max_context, "set explicitly", "flag")
        if not self.bounded:
            return Decision("max_context", self.ceiling, "no budget given: the model's context")
        found = self.plan().max_context_that_fits()  # over the whole pool (num_blocks free)
        if found < 1:
            raise self._does_not_fit()
        self.replace(max_context=found)
        plan = self.plan()
        capped = " (the model's context)" if found == self.ceiling else ""
        why = (
            f"the largest that fits {self.limit} at max_seqs={self.config.max_seqs}"
            f"{capped}: worst case {format_bytes(plan.worst_case_bytes)} ({_arenas(plan)})"
        )
        return Decision("max_context", found, why, "sized")

    def _size_ring(self) -> list[Decision]:
        """The logical context (positions) and the ring window that holds KV: the window
        is the largest that fits; the context is the model's unless activations forbid."""
        context = self.config.max_context
        if "max_context" not in self.fixed and self.bounded:
            least = min(MIN_RING_WINDOW, context)
            context = _largest(lambda c: self.plan(max_context=c, ring_window=least).fits, context)
            if context < 1:
                raise self._does_not_fit()
            self.replace(max_context=context)
        decisions = [self._context_decision(context)]
        if "ring_window" in self.fixed:
            decisions.append(Decision("ring_window", self.config.ring_window, "set", "flag"))
        elif not self.bounded or self.plan(ring_window=context).fits:
            # The whole context fits: the ring never wraps and the pool places it flat.
            self.replace(ring_window=context)
            why = "the whole context fits: no eviction"
            decisions.append(Decision("ring_window", context, why, "sized"))
        else:
            top = max(context - self.config.sinks - 1, 1)
            window = _largest(lambda w: self.plan(ring_window=w).fits, top)
            if window < 1:
                raise self._does_not_fit()
            self.replace(ring_window=window)
            plan = self.plan()
            why = (
                f"the largest ring that fits {self.limit}: older positions leave the window "
                f"(worst case {format_bytes(plan.worst_case_bytes)}: {_arenas(plan)})"
            )
            decisions.append(Decision("ring_window", window, why, "sized"))
        return decisions

    def _context_decision(self, context: int) -> Decision:
        if "max_context" in self.fixed:
            return Decision("max_context", context, "set explicitly", "flag")
        if context == self.ceiling:
            why = "the model's context: the ring, not the context, bounds the KV"
        else:
            why = f"the longest whose activations fit {self.limit} with a small ring"
        return Decision("max_context", context, why, "sized")

    def _size_prefix_cache(self) -> Decision:
        """The row's share of the planned pool, in whole blocks (the plan's own rounding)."""
        share = self.row.prefix_cache_share
        if "prefix_cache_bytes" not in self.fixed and self.plan().parks_slots:
            self.config = with_parked_slots(self.config, self.model)
            why = (
                "parked slots: a finished turn's slot keeps its KV until a request needs "
                "the slot, so the next turn computes only its new tokens (nothing copied "
                "or pinned; the budget is one session's KV)"
            )
            return Decision("prefix_cache_bytes", self.config.prefix_cache_budget, why, "sized")
        if "prefix_cache_bytes" in self.fixed or not share:
            return self._given_or("prefix_cache_bytes", _DEFAULT_REASONS["prefix_cache_bytes"])
        self.config = with_prefix_cache_share(self.config, self.model, share)
        prefix = self.plan().prefix_cache
        pinnable = prefix["pinnable_bytes"] if prefix else 0
        if not pinnable:
            why = f"off: {share:.0%} of this pool is less than one block"
            return Decision("prefix_cache_bytes", 0, why, "sized")
        assert prefix is not None
        why = (
            f"{prefix['blocks']} blocks, {format_bytes(pinnable)} ({prefix['pool_fraction']:.0%}"
            f" of the KV pool): {self.row.reasons.get('prefix_cache_bytes', '')}"
        )
        return Decision("prefix_cache_bytes", pinnable, why, "sized")

    def _does_not_fit(self) -> PlanError:
        cell = self.config.kv_layout == "cell"
        plan = self.plan(max_context=self.config.block_size if cell else 1, ring_window=1)
        refusal = plan.runtime_refusal()  # the runtime alone is over the budget: say so
        if refusal is not None:
            return refusal
        return PlanError(
            f"preset {self.row.name} does not fit {self.limit} at max_seqs="
            f"{self.config.max_seqs} even with the smallest context: weights "
            f"({format_bytes(self.weight_bytes)}) and activations alone need "
            f"{format_bytes(plan.worst_case_bytes - plan.kv_bytes)} ({_arenas(plan)}). Raise "
            "the budget, load "
            "smaller weights (--weights gguf keeps a GGUF file's quantised blocks) or lower "
            "max_batch_tokens."
        )


def _arenas(plan: CapacityPlan) -> str:
    return ", ".join(f"{name} {format_bytes(size)}" for name, size in plan.arenas.items())


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """Largest n in [1, high] with fits(n), fits being monotone; 0 if none."""
    low = 1
    if high < low or not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
