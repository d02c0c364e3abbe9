"""Workload presets: the on-device serving table, and the engine settings each row implies.

A preset turns a workload shape (``chat``, ``chat+background``, ``voice``,
``document-agent``, ``shared-prompt``) and a memory budget into `EngineConfig` keyword
arguments, each with the reason it was chosen (`choose_preset`). The fixed decisions come
from the table row (layout, concurrency, policy, queue, background share, sinks); the sized
ones (``max_context``, and the ring window of ``document-agent``) are the largest that
`CapacityPlan` says fit the budget for that shape. Settings the caller gives explicitly
(command-line flags, keyword overrides) replace the row's, and the sized ones are then
computed around them.

This module sits below the engine (it needs only `ModelInfo`, `KVConfig` and
`CapacityPlan`), so that ``EngineConfig.preset`` can build on it; it never touches a pool,
a model's weights or a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from slotserve.errors import PlanError
from slotserve.info import ModelInfo
from slotserve.kv.config import KVConfig
from slotserve.plan import CapacityPlan, MemoryMap, format_bytes, parse_bytes

log = logging.getLogger("slotserve")

PresetName = Literal["chat", "chat+background", "voice", "document-agent", "shared-prompt"]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)

# Background's minimum share of steps under ``isolate`` when it competes with other classes
# (the engine-wide default, too). At 0.1 a background job advances one step in ten while a
# chat turn streams, instead of waiting for the whole turn; `slotserve bench mixed` measures
# what it costs the chat turn's inter-token latency.
DEFAULT_BACKGROUND_SHARE = 0.1

# The smallest ring worth serving a document with: below it the window holds too little of
# the text for the model to follow it.
MIN_RING_WINDOW = 64

# Engine settings that are not the table's to choose; they keep the engine's defaults
# unless overridden.
_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_dtype": "fp32",
    "block_size": 16,
    "prefill_chunk": 256,
    "max_batch_tokens": 512,
}


@dataclass(frozen=True)
class PresetRow:
    """One row of the on-device serving table and the fixed settings it implies.

    ``reasons`` says, per setting, why the row chooses it (printed by ``slotserve plan``).
    """

    name: PresetName
    shape: str
    admission: str
    kv_layout: str
    max_seqs: int
    policy: str
    queue_depth: int
    queue_timeout_s: float
    background_min_share: float
    sinks: int
    prefix_cache: bool
    reasons: Mapping[str, str] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """The row's fixed `EngineConfig` settings."""
        return {
            "kv_layout": self.kv_layout,
            "max_seqs": self.max_seqs,
            "policy": self.policy,
            "queue_depth": self.queue_depth,
            "queue_timeout_s": self.queue_timeout_s,
            "background_min_share": self.background_min_share,
            "sinks": self.sinks,
        }


PRESETS: dict[str, PresetRow] = {
    row.name: row
    for row in (
        PresetRow(
            name="chat",
            shape="one long-lived session, user watching",
            admission="concurrency 1, reserve the whole budget",
            kv_layout="flat",
            max_seqs=1,
            policy="isolate",
            queue_depth=1,
            queue_timeout_s=30.0,
            background_min_share=DEFAULT_BACKGROUND_SHARE,
            sinks=0,
            prefix_cache=False,
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
            kv_layout="cell",
            max_seqs=4,
            policy="isolate",
            queue_depth=8,
            queue_timeout_s=120.0,
            background_min_share=DEFAULT_BACKGROUND_SHARE,
            sinks=0,
            prefix_cache=False,
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
            kv_layout="cell",
            max_seqs=4,
            policy="isolate",
            queue_depth=4,
            queue_timeout_s=2.0,
            background_min_share=DEFAULT_BACKGROUND_SHARE,
            sinks=0,
            prefix_cache=False,
            reasons={
                "kv_layout": "blocks return to the shared free list on every cancel "
                "(strict teardown, checked by check_integrity)",
                "max_seqs": "a few live turns: the one speaking and the ones barged in on",
                "policy": "the spoken turn (interactive) steps first",
                "queue_depth": "a barge-in's new turn waits only for the slot its cancelled "
                "turn frees at the next step",
                "queue_timeout_s": "a voice turn older than 2 s is stale: refuse it",
            },
        ),
        PresetRow(
            name="document-agent",
            shape="one session, context exceeds the window",
            admission="concurrency 1, accept window eviction",
            kv_layout="ring",
            max_seqs=1,
            policy="isolate",
            queue_depth=1,
            queue_timeout_s=60.0,
            background_min_share=DEFAULT_BACKGROUND_SHARE,
            sinks=4,
            prefix_cache=False,
            reasons={
                "kv_layout": "a ring bounds the footprint absolutely; the oldest positions "
                "leave the window",
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
            kv_layout="cell",
            max_seqs=8,
            policy="fifo",
            queue_depth=32,
            queue_timeout_s=30.0,
            background_min_share=DEFAULT_BACKGROUND_SHARE,
            sinks=0,
            prefix_cache=True,
            reasons={
                "kv_layout": "blocks shared copy-on-write: what prefix reuse is built on",
                "max_seqs": "many short requests step together",
                "policy": "co-batch everything: throughput first, one class of work",
                "queue_depth": "a burst waits and is admitted in batches as slots free",
            },
        ),
    )
}


@dataclass(frozen=True)
class Decision:
    """One setting of a preset, its value, and why (``flag``: the caller set it)."""

    setting: str
    value: Any
    why: str
    source: Literal["preset", "flag", "sized"] = "preset"


@dataclass(frozen=True)
class PresetChoice:
    """What a preset chose for a model and a budget: `EngineConfig` keyword arguments and
    the decisions behind them, one per setting."""

    row: PresetRow
    settings: Mapping[str, Any]
    decisions: tuple[Decision, ...]
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """One line per decision, each naming the table row (``slotserve plan --preset``)."""
        row = self.row
        lines = [f"preset {row.name}: {row.shape} → {row.kv_layout}, {row.admission}"]
        for d in self.decisions:
            lines.append(f"  [{row.name}] {d.setting} = {d.value}  ({d.source}: {d.why})")
        lines += [f"  [{row.name}] note: {note}" for note in self.notes]
        return lines


def estimated_weight_bytes(info: ModelInfo) -> int:
    """Resident fp32 weight bytes of a Llama-family model of this shape (what the loader
    builds by default; a `Model` gives the exact figure, int8 weights included)."""
    q_width = info.n_heads * info.head_dim
    per_layer = (
        2 * info.dim  # the two RMSNorms
        + info.dim * (q_width + 2 * info.kv_dim)  # qkv
        + q_width * info.dim  # o
        + 3 * info.dim * info.ffn_dim  # gate, up, down
        + (q_width + 2 * info.kv_dim if info.qkv_bias else 0)
        + (2 * info.head_dim if info.qk_norm else 0)
    )
    embeddings = info.vocab_size * info.dim * (1 if info.tied_embeddings else 2)
    return 4 * (embeddings + info.dim + info.n_layers * per_layer)


def choose_preset(
    name: str,
    info: ModelInfo,
    weight_bytes: int,
    memory_budget: int | str | None,
    overrides: Mapping[str, Any] | None = None,
) -> PresetChoice:
    """The settings of preset ``name`` for a model (``info``, ``weight_bytes``) and a
    budget. ``overrides`` (settings the caller fixed) replace the row's; ``max_context``
    and the ring window are then sized around them. Raises `ValueError` for an unknown
    preset and `PlanError` when the shape does not fit the budget at any context."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {', '.join(PRESET_NAMES)}")
    row = PRESETS[name]
    fixed = dict(overrides or {})
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    settings: dict[str, Any] = {**_ENGINE_DEFAULTS, **row.settings(), **fixed}
    # A memory map replaces the total budget (the plan takes one or the other).
    settings["memory_budget"] = None if fixed.get("memory_map") is not None else budget
    decisions = [_decision(row, key, settings[key], fixed) for key in row.settings()]
    decisions += [
        Decision(key, value, "set explicitly", "flag")
        for key, value in fixed.items()
        if key not in row.settings() and key not in ("max_context", "ring_window")
    ]
    sizer = _Sizer(info, weight_bytes, settings, budget, fixed.get("memory_map"))
    decisions += sizer.size(row.name)
    notes = _prefix_cache_notes(row)
    for note in notes:
        log.warning("preset %s: %s", row.name, note)
    return PresetChoice(row, settings, tuple(decisions), notes)


def _decision(row: PresetRow, key: str, value: Any, fixed: Mapping[str, Any]) -> Decision:
    if key in fixed:
        return Decision(key, value, "set explicitly, overriding the row", "flag")
    why = row.reasons.get(key) or _DEFAULT_REASONS[key]
    return Decision(key, value, why)


_DEFAULT_REASONS = {
    "policy": "never co-batch classes; interactive first",
    "queue_depth": "requests may wait for a slot",
    "queue_timeout_s": "the longest a queued request waits before it is refused",
    "background_min_share": "background is never starved: it takes at least this share of "
    "steps when it competes (engine default)",
    "sinks": "no attention sinks (not a ring layout)",
}


def _prefix_cache_notes(row: PresetRow) -> tuple[str, ...]:
    if not row.prefix_cache:
        return ()
    # Said plainly rather than pretending: the row asks for prefix reuse, the runtime does
    # not have it yet, so every request prefills its whole prompt.
    return (
        "the prefix cache is unavailable (not implemented yet): the shared prefix is "
        "prefilled again by every request; only the admission shape of this row applies",
    )


class _Sizer:
    """Sizes ``max_context`` (and the ring window) to the budget with `CapacityPlan`."""

    def __init__(
        self,
        info: ModelInfo,
        weight_bytes: int,
        settings: dict[str, Any],
        budget: int | None,
        memory_map: MemoryMap | None,
    ) -> None:
        self.info, self.weight_bytes, self.settings = info, weight_bytes, settings
        self.budget, self.memory_map = budget, memory_map

    def plan(self, **kv: Any) -> CapacityPlan:
        s = {**self.settings, **kv}
        config = KVConfig(
            layout=s["kv_layout"],
            max_seqs=s["max_seqs"],
            max_context=s["max_context"],
            block_size=s["block_size"],
            dtype=s["kv_dtype"],
            ring_window=s.get("ring_window", 1024),
            sinks=s["sinks"],
            num_blocks=s.get("num_blocks"),
        )
        budget = None if self.memory_map is not None else self.budget
        return CapacityPlan(
            self.info, config, self.weight_bytes, s["max_batch_tokens"], budget, self.memory_map
        )

    @property
    def limit(self) -> str:
        if self.memory_map is not None:
            return f"the memory map {self.memory_map}"
        assert self.budget is not None
        return f"the budget {format_bytes(self.budget)}"

    def size(self, row: str) -> list[Decision]:
        """Fill ``max_context`` and ``ring_window`` in the settings; their decisions."""
        if self.settings["kv_layout"] == "ring":
            decisions = self._size_ring(row)
        else:
            decisions = [self._size_context(row)]
            self.settings.setdefault("ring_window", 1024)
            decisions.append(self._fixed_or("ring_window", "not used (no ring layout)"))
        if self.budget is not None or self.memory_map is not None:
            self.plan().check()  # explicit settings may still not fit: say which lever
        return decisions

    def _fixed_or(self, key: str, why: str) -> Decision:
        return Decision(key, self.settings[key], why, "preset")

    def _model_ceiling(self) -> int:
        """The model's context, rounded down to whole blocks for the cell layout."""
        step = self.settings["block_size"] if self.settings["kv_layout"] == "cell" else 1
        return self.info.max_context // step * step

    def _size_context(self, row: str) -> Decision:
        if "max_context" in self.settings:
            return Decision("max_context", self.settings["max_context"], "set explicitly", "flag")
        ceiling = self._model_ceiling()
        if self.budget is None and self.memory_map is None:
            self.settings["max_context"] = ceiling
            return Decision("max_context", ceiling, "no budget given: the model's context")
        found = self.plan(max_context=ceiling, num_blocks=None).max_context_that_fits()
        if found < 1:
            raise self._does_not_fit(row)
        self.settings["max_context"] = found
        plan = self.plan()
        capped = " (the model's context)" if found == ceiling else ""
        why = (
            f"the largest that fits {self.limit} at max_seqs={self.settings['max_seqs']}"
            f"{capped}: worst case {format_bytes(plan.worst_case_bytes)} "
            f"({_arenas(plan)})"
        )
        return Decision("max_context", found, why, "sized")

    def _size_ring(self, row: str) -> list[Decision]:
        """The logical context (positions) and the ring window that holds KV: the window
        is the largest that fits; the context is the model's unless activations forbid."""
        sinks = self.settings["sinks"]
        context = self.settings.get("max_context") or self._model_ceiling()
        unbounded = self.budget is None and self.memory_map is None
        if "max_context" not in self.settings and not unbounded:
            least = min(MIN_RING_WINDOW, context)
            context = _largest(lambda c: self.plan(max_context=c, ring_window=least).fits, context)
            if context < 1:
                raise self._does_not_fit(row)
        self.settings["max_context"] = context
        decisions = [self._context_decision(context)]
        if "ring_window" in self.settings:
            decisions.append(Decision("ring_window", self.settings["ring_window"], "set", "flag"))
        elif unbounded or self.plan(ring_window=context).fits:
            # The whole context fits: the ring never wraps and the pool places it flat.
            self.settings["ring_window"] = context
            why = "the whole context fits: no eviction"
            decisions.append(Decision("ring_window", context, why, "sized"))
        else:
            top = max(context - sinks - 1, 1)
            window = _largest(lambda w: self.plan(ring_window=w).fits, top)
            if window < 1:
                raise self._does_not_fit(row)
            self.settings["ring_window"] = window
            plan = self.plan()
            why = (
                f"the largest ring that fits {self.limit}: older positions leave the window "
                f"(worst case {format_bytes(plan.worst_case_bytes)}: {_arenas(plan)})"
            )
            decisions.append(Decision("ring_window", window, why, "sized"))
        return decisions

    def _context_decision(self, context: int) -> Decision:
        if context == self._model_ceiling():
            why = "the model's context: the ring, not the context, bounds the KV"
        else:
            why = f"the longest whose activations fit {self.limit} with a small ring"
        return Decision("max_context", context, why, "sized")

    def _does_not_fit(self, row: str) -> PlanError:
        cell = self.settings["kv_layout"] == "cell"
        plan = self.plan(max_context=self.settings["block_size"] if cell else 1, ring_window=1)
        return PlanError(
            f"preset {row} does not fit {self.limit} at max_seqs={self.settings['max_seqs']} "
            f"even with the smallest context: weights and activations alone need "
            f"{format_bytes(plan.worst_case_bytes - plan.kv_bytes)}. Raise the budget, load "
            f"int8 weights (--weights int8) or lower max_batch_tokens."
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
