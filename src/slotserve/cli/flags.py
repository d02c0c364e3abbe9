"""Flags shared by several commands, and the one mapping of engine flags to `EngineConfig`.

Engine flags default to None ("not given"), so that `engine_config` can tell an explicit
flag from a default: without ``--preset`` the defaults are `EngineConfig`'s own; with
``--preset NAME`` they are the preset's, and explicit flags override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from slotserve.engine.config import (
    BUDGET_SCOPES,
    DEFAULT_PREFIX_STORE_BYTES,
    DEFAULT_PREFIX_STORE_MIN_TOKENS,
    DEFAULT_PREFIX_STORE_WRITE_RATE,
    DRAFT_WEIGHTS,
    SPECULATE_MODES,
    EngineConfig,
)
from slotserve.engine.presets import PRESET_NAMES, PresetChoice, choose_preset
from slotserve.engine.pressure import (
    PRESSURE_SPELLINGS,
    PressureSource,
    check_spelling,
    pressure_from,
)
from slotserve.kv.config import KV_DTYPES
from slotserve.memory import MemoryLedger, MemoryMap, parse_bytes

# Engine flags: argparse dest → (EngineConfig field, type, choices, help).
ENGINE_FLAGS: dict[str, tuple[str, Any, tuple[str, ...] | None, str]] = {
    "max_seqs": ("max_seqs", int, None, "live sessions at most"),
    "max_context": ("max_context", int, None, "positions per session"),
    "kv_layout": ("kv_layout", str, ("flat", "ring", "cell"), "KV layout"),
    "kv_dtype": (
        "kv_dtype",
        str,
        tuple(KV_DTYPES),
        "KV element type: fp16 and bf16 half fp32's bytes, int8 about a quarter (a scale per row)",
    ),
    "block_size": ("block_size", int, None, "cell layout: positions per block"),
    "num_blocks": ("num_blocks", int, None, "cell layout: blocks in the pool"),
    "ring_window": ("ring_window", int, None, "ring layout: positions kept"),
    "sinks": ("sinks", int, None, "ring layout: first positions kept forever"),
    "max_batch_tokens": ("max_batch_tokens", int, None, "tokens one step computes at most"),
    "policy": ("policy", str, ("isolate", "fifo"), "isolate: never co-batch classes"),
    "queue_depth": ("queue_depth", int, None, "requests that may wait for a slot"),
    "queue_timeout": ("queue_timeout_s", float, None, "seconds a queued request may wait"),
    "prefix_cache": (
        "prefix_cache_bytes",
        parse_bytes,
        None,
        "cell layout: KV bytes the prefix cache may pin (e.g. 256MiB; 0: off)",
    ),
    "kernels": (
        "kernels",
        str,
        ("auto", "off"),
        "compiled C kernels: auto (build for this CPU, once) or off (torch ops only)",
    ),
    "background_share": (
        "background_min_share",
        float,
        None,
        "isolate: background's minimum share of steps when it competes, in [0, 1)",
    ),
    "speculate": (
        "speculate",
        str,
        SPECULATE_MODES,
        "ngram: verify tokens drafted from each request's prompt and output in one step, the "
        "output unchanged bit for bit (serve's default, where the model keeps that exact); "
        "draft: tokens drafted by --draft-model instead; off",
    ),
    "draft_model": (
        "draft_model",
        str,
        None,
        "a model of the same vocabulary that drafts tokens for --speculate draft (implies "
        "it): a smaller one of the family, or the same file in another --draft-weights; its "
        "weights, KV and activations are arenas of the memory plan",
    ),
    "draft_weights": (
        "draft_weights",
        str,
        DRAFT_WEIGHTS,
        "how --draft-model's weights are held (as --weights)",
    ),
}
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["auto", "gguf", "fp32", "int8"],
        default="auto",
        help="how a .gguf/HF model's weights are held: gguf keeps a GGUF file's Q4_0, Q4_1, "
        "Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (its size in memory, the fastest "
        "decode); fp32 dequantises; int8 quantises fp32 projections; auto (default): gguf "
        "where the file has such blocks",
    )


def add_preset_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="workload preset: sizes the engine for a workload shape and --memory-budget "
        "(explicit flags override it; `slotserve plan --preset NAME` says why)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Model and sampling flags of the single-caller commands (generate, chat)."""
    parser.add_argument("--model", default="bundled", help="'bundled', a .gguf file or an HF dir")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-context", type=int, default=None)
    add_weights_arg(parser)


def add_engine_args(parser: argparse.ArgumentParser, *, model_set: bool = False) -> None:
    """Flags shared by every command that sizes a KV pool (read by `engine_config`).
    ``model_set``: ``--model`` may be repeated (``NAME=SPEC`` or ``SPEC``) and ``--models
    FILE`` names a TOML set (`model_specs`); one plain ``--model`` behaves as without it."""
    if model_set:
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            metavar="[NAME=]SPEC",
            help="'bundled', a .gguf file, an HF dir or a named model (default bundled); "
            "repeat to serve several in one process, each as NAME (default: its own id)",
        )
        parser.add_argument(
            "--models",
            type=Path,
            default=None,
            metavar="FILE",
            help="a TOML file of models, one [models.NAME] table each: source, resident "
            "(default true; false: loaded on demand), keep_alive (seconds), and engine "
            "settings (max_seqs, max_context, kv_layout, kv_dtype, prefix_cache, preset …); "
            "see docs/MODELS.md",
        )
    else:
        parser.add_argument(
            "--model", default="bundled", help="'bundled', a .gguf file or an HF dir"
        )
    add_weights_arg(parser)
    add_preset_arg(parser)
    for dest, (field, kind, choices, text) in ENGINE_FLAGS.items():
        default = _CONFIG_DEFAULTS[field]
        parser.add_argument(
            "--" + dest.replace("_", "-"),
            dest=dest,
            type=kind,
            choices=choices,
            default=None,
            help=f"{text} (default {default}, or the preset's)",
        )
    parser.add_argument("--memory-budget", default=None, help="e.g. 1GiB, 512MB, 1073741824")
    parser.add_argument(
        "--budget-scope",
        choices=BUDGET_SCOPES,
        default="process",
        help="what --memory-budget holds: process (default) the whole process's anonymous "
        "memory, its runtime and weights as measured at load included; model the model's "
        "arenas only",
    )
    parser.add_argument(
        "--memory-map",
        default=None,
        metavar="ARENA=BYTES,...",
        help="a budget per arena instead of a total, every arena the plan holds named (e.g. "
        "runtime=300MiB,tokenizer=32MiB,weights=128MiB,kv=64MiB,activations=32MiB,"
        "grammar_index=64MiB,grammars=128MiB; `slotserve plan` lists them)",
    )


def add_prefix_store_args(parser: argparse.ArgumentParser) -> None:
    """``--prefix-store DIR``, ``--prefix-store-bytes``, ``--prefix-store-write-rate`` and
    ``--prefix-store-min-tokens`` (read by `with_prefix_store`)."""
    parser.add_argument(
        "--prefix-store",
        default=None,
        metavar="DIR",
        help="the prefix cache's disk tier: snapshots written to DIR in the background, "
        "checked (model, numerics, KV layout, checksum) and restored after a restart; "
        "needs the prefix cache on. A DIR that cannot be written is an error at start",
    )
    parser.add_argument(
        "--prefix-store-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help=f"disk the prefix store may use, least recently used files evicted first "
        f"(default {DEFAULT_PREFIX_STORE_BYTES})",
    )
    parser.add_argument(
        "--prefix-store-write-rate",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="bytes a second the prefix store may write on average (flash wears); a "
        f"snapshot past it is skipped and counted (default {DEFAULT_PREFIX_STORE_WRITE_RATE})",
    )
    parser.add_argument(
        "--prefix-store-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="write only snapshots of at least N tokens: shorter ones are cheaper to compute "
        f"again (default {DEFAULT_PREFIX_STORE_MIN_TOKENS})",
    )


def with_prefix_store(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """``config`` with the disk tier of ``--prefix-store`` (unchanged without it), once
    the prefix cache is decided; `ValueError` if the cache is off."""
    directory = getattr(args, "prefix_store", None)
    if directory is None:
        return config
    if not config.prefix_cache_budget:
        raise ValueError(
            f"--prefix-store {directory} is the prefix cache's disk tier, and the cache is off "
            "(--no-prefix-cache, a layout other than --kv-layout cell, or a model where a "
            "restore is not bit-exact: see the log); pass --prefix-cache BYTES to turn it on"
        )
    store_bytes = args.prefix_store_bytes or DEFAULT_PREFIX_STORE_BYTES
    rate = getattr(args, "prefix_store_write_rate", None) or DEFAULT_PREFIX_STORE_WRITE_RATE
    min_tokens = getattr(args, "prefix_store_min_tokens", None)
    if min_tokens is None:
        min_tokens = DEFAULT_PREFIX_STORE_MIN_TOKENS
    return dataclasses.replace(
        config, prefix_store=directory, prefix_store_bytes=store_bytes,
        prefix_store_write_rate=rate, prefix_store_min_tokens=min_tokens,
    )  # fmt: skip


def add_pressure_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pressure",
        type=_pressure_spec,
        default="auto",
        metavar="SOURCE",
        help=f"device-pressure signal: {PRESSURE_SPELLINGS} (default auto: thermal where a "
        "thermal zone can be read, else off; logged). Under pressure background work "
        "pauses (admission refuses with 'pressure'; running background requests take no "
        "step, their KV kept, until it clears) and batches halve; file:PATH reads a level "
        "(1.0 = threshold) that another process writes",
    )


def _pressure_spec(text: str) -> str:
    """Check the spelling at parse time, before a model is loaded."""
    try:
        check_spelling(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def pressure_source(args: argparse.Namespace) -> PressureSource | None:
    """The `PressureSource` of ``--pressure`` (None for ``off``, or ``auto`` without a
    readable thermal zone)."""
    return pressure_from(args.pressure)


def explicit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the engine flags set explicitly (not left at None)."""
    settings = {
        field: getattr(args, dest)
        for dest, (field, *_rest) in ENGINE_FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    if "draft_model" in settings and "speculate" not in settings:
        settings["speculate"] = "draft"  # --draft-model drafts unless told otherwise
    settings["budget_scope"] = getattr(args, "budget_scope", "process")
    memory_map = memory_map_from(getattr(args, "memory_map", None))
    if memory_map is not None:
        settings["memory_map"] = memory_map
    return settings


def engine_config(
    args: argparse.Namespace, model: Any = None, ledger: MemoryLedger | None = None
) -> EngineConfig:
    """The `EngineConfig` of the engine flags (see `resolve_engine_config`)."""
    return resolve_engine_config(args, model, ledger)[0]


def resolve_engine_config(
    args: argparse.Namespace, model: Any = None, ledger: MemoryLedger | None = None
) -> tuple[EngineConfig, PresetChoice | None]:
    """The one place engine defaults are resolved: `EngineConfig`'s own defaults, or with
    ``--preset`` the preset's choice for ``model`` (a loaded `Model`) and the budget, sized
    against ``ledger`` (every arena the command adds besides the engine's own: `ledger_for`
    fills the model's), with the reasons; explicit flags override either."""
    settings = explicit_settings(args)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    preset = getattr(args, "preset", None)
    if preset is None:
        return EngineConfig(**settings, memory_budget=budget), None
    if model is None:
        raise ValueError(f"--preset {preset} sizes the engine for a model; load it first")
    choice = choose_preset(preset, model, budget, ledger=ledger, **settings)
    return choice.config, choice


def memory_map_from(text: str | None) -> MemoryMap | None:
    """``"runtime=300MiB,weights=100MiB,..."`` → `MemoryMap` (every arena the plan holds
    needs a limit: `slotserve plan` lists them)."""
    return MemoryMap.parse(text) if text else None


# The settings a --models table may give besides source, resident and keep_alive: the
# engine flags (`ENGINE_FLAGS`, by dest) and these.
MODEL_FILE_KEYS = (
    "source", "resident", "keep_alive", "preset", "weights", *ENGINE_FLAGS,
    "max_texts", "max_batch_texts",  # an encoder's (`EncoderConfig`)
)  # fmt: skip


def model_specs(args: argparse.Namespace, name_of: Any) -> list[Any] | None:
    """The `ModelSpec`s of ``--model`` (repeated, ``NAME=SPEC`` or ``SPEC`` named
    ``name_of(SPEC)``) and ``--models FILE``; None for the one-model server (one plain
    ``--model``, or none), which then runs exactly as before. Sets ``args.model`` to the
    one model's spec in that case. `ValueError` naming a bad entry."""
    from slotserve.engine.models import ModelSpec

    given = args.model or []
    file = getattr(args, "models", None)
    if file is None and len(given) <= 1 and not any("=" in g for g in given):
        args.model = given[0] if given else "bundled"
        return None
    specs = []
    for text in given:
        name, sep, source = text.partition("=")
        if not sep:
            name, source = name_of(text), text
        specs.append(ModelSpec(name=name.strip(), source=source.strip()))
    if file is not None:
        specs.extend(_file_specs(file))
    return specs


def _file_specs(path: Path) -> list[Any]:
    from slotserve.engine.models import ModelSpec

    try:
        tables = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models {path}: cannot read it ({exc})") from None
    models = tables.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(
            f'--models {path}: no [models.NAME] table; write e.g. [models.chat] source = "bundled"'
        )
    specs = []
    for name, table in models.items():
        if not isinstance(table, dict) or "source" not in table:
            raise ValueError(f'--models {path}: [models.{name}] needs source = "SPEC"')
        unknown = sorted(set(table) - set(MODEL_FILE_KEYS))
        if unknown:
            raise ValueError(
                f"--models {path}: [models.{name}] has unknown keys {unknown}; "
                f"known: {sorted(MODEL_FILE_KEYS)}"
            )
        settings = {k: v for k, v in table.items() if k not in ("source", "resident", "keep_alive")}
        keep_alive = table.get("keep_alive")
        specs.append(
            ModelSpec(
                name=name,
                source=str(table["source"]),
                resident=bool(table.get("resident", True)),
                keep_alive_s=None if keep_alive is None else float(keep_alive),
                settings=settings,
            )
        )
    return specs


def model_namespace(args: argparse.Namespace, spec: Any) -> argparse.Namespace:
    """``args`` as one model of a set sees them: ``--model`` its source, its own settings
    over the shared engine flags, no budget of its own (the set's device plan holds the
    budget: `slotserve.engine.models`)."""
    values = dict(vars(args))
    values.update(model=spec.source, memory_budget=None, memory_map=None)
    for key, value in spec.settings.items():
        kind = ENGINE_FLAGS[key][1] if key in ENGINE_FLAGS else None
        values[key] = kind(value) if kind is not None and isinstance(value, str) else value
    return argparse.Namespace(**values)
