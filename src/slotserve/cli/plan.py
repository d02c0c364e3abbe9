"""``slotserve plan``: print a capacity plan (table or JSON), optionally measured; with
``--preset``, first the preset's choice and why, one line per decision."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from slotserve.cli.flags import add_engine_args, resolve_engine_config
from slotserve.cli.serve import with_server_prefix_cache
from slotserve.plan import format_bytes


def register(commands: Any) -> None:
    parser = commands.add_parser("plan", help="memory plan for a model and engine settings")
    add_engine_args(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--measure", action="store_true", help="also allocate the pool and measure it"
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="plan without the server's default prefix cache (cell layout: a quarter of the pool)",
    )


def run(args: argparse.Namespace) -> int:
    from slotserve.artifact import load
    from slotserve.kv import KVPool
    from slotserve.memory import rss_bytes

    model = load(args.model, weights=args.weights)
    config, choice = resolve_engine_config(args, model)
    config = with_server_prefix_cache(config, args, model)  # as `slotserve serve` runs it
    plan = config.plan(model.info, model.weight_bytes)
    report = plan.to_dict()
    if choice is not None:
        report["preset"] = {
            "name": choice.row.name,
            "row": {"shape": choice.row.shape, "admission": choice.row.admission},
            "decisions": [_jsonable(dataclasses.asdict(d)) for d in choice.decisions],
        }
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
        return 0 if plan.fits else 1
    if choice is not None:
        # Plain print, not rich: the lines are the explanation, one per decision.
        print("\n".join(choice.lines()))
    _print_table(report)
    return 0 if plan.fits else 1


def _jsonable(decision: dict[str, Any]) -> dict[str, Any]:
    value = decision["value"]
    if not isinstance(value, int | float | str | bool | None):
        decision["value"] = str(value)
    return decision


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
    prefix = report.get("prefix_cache")
    if isinstance(prefix, dict):
        share = f" ({prefix['pool_fraction']:.0%} of the KV pool)"
        table.add_row("prefix cache may pin" + share, format_bytes(prefix["pinnable_bytes"]))
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
