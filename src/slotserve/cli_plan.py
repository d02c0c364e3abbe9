"""``slotserve plan``: print a capacity plan (table or JSON), optionally measured."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from slotserve.engine.config import EngineConfig
from slotserve.kv import KVPool
from slotserve.memory import rss_bytes
from slotserve.plan import MemoryMap, format_bytes, parse_bytes


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from the flags of `slotserve.cli.add_engine_args`."""
    return EngineConfig(
        max_seqs=args.max_seqs,
        max_context=args.max_context,
        kv_layout=args.kv_layout,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        ring_window=args.ring_window,
        sinks=args.sinks,
        num_blocks=args.num_blocks,
        memory_budget=parse_bytes(args.memory_budget) if args.memory_budget else None,
        memory_map=memory_map_from(args.memory_map),
        policy=args.policy,
        max_batch_tokens=args.max_batch_tokens,
        queue_depth=args.queue_depth,
        queue_timeout_s=args.queue_timeout,
    )


def memory_map_from(text: str | None) -> MemoryMap | None:
    """``"600MiB,256MiB,128MiB"`` (weights,kv,activations) → `MemoryMap`."""
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 3:
        raise ValueError(f"--memory-map {text!r}: expected weights,kv,activations")
    return MemoryMap.parse(*parts)


def run_plan(args: argparse.Namespace) -> int:
    from slotserve.artifact import load

    model = load(args.model, weights=args.weights)
    plan = engine_config(args).plan(model.info, model.weight_bytes)
    report = plan.to_dict()
    if args.measure:
        before = rss_bytes()
        pool = KVPool(model.info, plan.kv)
        report["measured"] = {
            "pool_bytes": pool.nbytes,
            "weight_bytes": model.weight_bytes,
            "rss_growth_for_pool_bytes": rss_bytes() - before,
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0 if plan.fits else 1


def _print_table(report: dict[str, object]) -> None:
    table = Table(title=f"capacity plan ({report['layout']}, {report['kv_dtype']} KV)")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    arenas = report["arenas"]
    assert isinstance(arenas, dict)
    for name, size in arenas.items():
        table.add_row(f"arena: {name}", format_bytes(size))
    for key in ("bytes_per_session", "worst_case_bytes", "memory_budget", "headroom_bytes"):
        value = report[key]
        table.add_row(key, format_bytes(value) if isinstance(value, int) else "-")
    measured = report.get("measured")
    if isinstance(measured, dict):
        for name, size in measured.items():
            table.add_row(f"measured: {name}", format_bytes(size))
    console = Console()
    console.print(table)
    console.print(
        f"fits: {report['fits']} · max_seqs that fit: {report['max_seqs_that_fit']} · "
        f"max_context that fits: {report['max_context_that_fits']}"
    )
