"""``slotserve plan``: print a capacity plan (table or JSON) of the whole process (the arenas
``slotserve serve`` checks with the same flags, its grammars arena and its grammar
compiler's tokenizer index included, and the model load's peak), with the
declared cancellation bound and, with ``--prefix-store``, the disk store's budget and what
it holds now (its snapshots, their bytes and the time to index them, read from the headers
as ``serve`` would at start, nothing changed on disk); with
``--measure``, each arena measured beside its planned bytes (`slotserve.engine.plan_measure`);
with ``--preset``, first the preset's choice and why, one line per decision."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from slotserve.cli.flags import (
    add_engine_args,
    add_prefix_store_args,
    explicit_settings,
    model_specs,
    resolve_engine_config,
    with_prefix_store,
)
from slotserve.cli.serve import (
    add_grammar_args,
    add_server_arenas,
    grammar_config,
    import_server,
    model_set,
    prepare_grammars,
    served_name,
    with_server_prefix_cache,
)
from slotserve.engine.presets import least_budget
from slotserve.memory import format_bytes

# plan measures its own process, and serve measures its own: the arenas both measure read
# apart between two runs of one command, the tokenizer's by up to 3 MiB (the tokenizer
# library's allocations land differently in the heap from run to run), the grammar
# compiler's by a few hundred KiB. plan reserves this much more for the start than serve
# does, so that a budget plan says fits, serve starts at.
PLAN_MARGIN = 4 << 20
PLAN_MARGIN_SOURCE = "plan's readings are not serve's"


def register(commands: Any) -> None:
    parser = commands.add_parser("plan", help="memory plan for a model and engine settings")
    add_engine_args(parser, model_set=True)  # several --model, or --models FILE: their set
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also measure each arena: allocate the pool, run the largest step (and time it: "
        "the cancellation bound)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="plan without the server's default prefix cache (cell layout: a quarter of the pool)",
    )
    add_prefix_store_args(parser)
    add_grammar_args(parser)  # serve's flags: the grammars arena is --grammar-cache-bytes


def run(args: argparse.Namespace) -> int:
    import_server()  # the process serve will be: its runtime arena holds the server's code
    specs = model_specs(args, served_name)
    if specs is not None:
        return _plan_models(args, specs)
    return _plan_one(args)


def _plan_models(args: argparse.Namespace, specs: list[Any]) -> int:
    """The device plan of a set of models, made as ``serve`` makes it (`model_set`: every
    model loaded and planned, the on-demand ones then unloaded): the shared arenas, each
    model's bytes and arenas, what the budget must hold, and whether it does."""
    models = model_set(args, specs, grammar_config(args))
    assert models.ledger is not None  # `model_set` keeps the device's arenas in one
    models.ledger.add("start", PLAN_MARGIN, "reserved", PLAN_MARGIN_SOURCE)
    try:
        models.start(check=False)
        cards, problems = models.cards(), models.problems()
        shared, required = models.shared_bytes, models.required_bytes
        report: dict[str, Any] = {
            "budget": models.budget,
            "shared_bytes": shared,
            "models": cards,
            "arenas": models.arenas(),
            "required_bytes": required,
            "problems": problems,
            "fits": not problems,
        }
    finally:
        models.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if not problems else 1
    table = Table(title="device plan (every model, one budget)")
    table.add_column("model")
    table.add_column("kept", justify="left")
    table.add_column("planned", justify="right")
    table.add_row("(shared arenas)", "always", format_bytes(shared))
    for card in cards:
        kept = "resident" if card["resident"] else "on demand"
        table.add_row(card["id"], kept, format_bytes(card["bytes"]))
    table.add_row("required (largest on-demand once)", "", format_bytes(required))
    console = Console()
    console.print(table)
    budget = models.budget
    console.print(f"fits: {not problems} (budget {format_bytes(budget) if budget else 'none'})")
    for problem in problems:
        console.print(problem)
    return 0 if not problems else 1


def _plan_one(args: argparse.Namespace) -> int:
    import torch

    from slotserve.artifact import load
    from slotserve.engine.cancel_bound import declare_cancel_bound, largest_step_tokens
    from slotserve.engine.plan_measure import measure_arenas
    from slotserve.engine.probe import command_ledger, ledger_for
    from slotserve.executor import executor_for
    from slotserve.kv import KVPool
    from slotserve.prefix.store import survey_store

    grammars = grammar_config(args)  # checked before the model loads, as serve does
    model = load(args.model, weights=args.weights)
    # serve's ledger, filled as serve fills it: the load's arenas, the grammar compiler's
    # index built and measured here, the grammars and the stored responses
    # (`cli.serve.add_server_arenas`),
    # then the engine's probes (`ledger_for`), before a preset is sized against it
    compiler, grammar_cost = prepare_grammars(model, grammars)
    compiler.close()
    ledger = command_ledger(model, args.budget_scope)
    chats = model.tokenizer.chat_template is not None
    add_server_arenas(ledger, args.budget_scope, grammars.cache_bytes, grammar_cost, chats=chats)
    if args.budget_scope == "process":
        ledger.add("start", PLAN_MARGIN, "reserved", PLAN_MARGIN_SOURCE)
    config, choice = resolve_engine_config(args, model, ledger)
    config = with_server_prefix_cache(config, args, model)  # as `slotserve serve` runs it
    config = with_prefix_store(config, args)
    ledger = ledger_for(model, config, executor_for(model), ledger)
    kernel = config.kernels == "auto" and model.kernels.attention is not None
    plan = config.plan(model.info, ledger, attention_kernel=kernel)
    report = plan.to_dict()
    report["budget_scope"] = config.budget_scope
    bound = declare_cancel_bound(largest_step_tokens(config), {}, [])
    if config.prefix_store is not None:
        # What serve would index there now (headers only; nothing on disk changes). The
        # store's identity is the pool's shapes and dtypes: a pool on the meta device has
        # them and holds no memory (a real one was the whole KV pool, for a plan).
        attention = model.kernels.attention if config.kernels == "auto" else None
        with torch.device("meta"):
            shapes = KVPool(model.info, config.kv_config(), attention)
        survey = survey_store(
            config.prefix_store, model, shapes, attention_kernel=attention is not None
        )
        report["prefix_store"] = {**survey.to_dict(), "budget_bytes": config.prefix_store_budget}
    if choice is not None:
        report["preset"] = {
            "name": choice.row.name,
            "row": {"shape": choice.row.shape, "admission": choice.row.admission},
            "decisions": [_jsonable(dataclasses.asdict(d)) for d in choice.decisions],
        }
        if config.memory_map is None:  # the least total budget it starts at
            settings = explicit_settings(args)
            least = least_budget(choice.row.name, model, ledger=ledger, **settings)
            report["preset"]["least_budget_bytes"] = least
    if args.measure:
        pool_bytes = KVPool(model.info, plan.kv).nbytes
        measured = measure_arenas(model, config, ledger=ledger)
        bound = measured.cancel_bound
        report["measured"] = {
            "pool_bytes": pool_bytes,
            "weight_bytes": model.weight_bytes,
            "arenas": measured.arenas,
        }
    report["cancel_bound"] = {**bound.to_dict(), "description": bound.describe()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if plan.fits else 1
    if choice is not None:
        # Plain print, not rich: the lines are the explanation, one per decision.
        print("\n".join(choice.lines()))
        least = report["preset"].get("least_budget_bytes")
        if least is not None:
            print(f"  [{choice.row.name}] fits any --memory-budget from {format_bytes(least)}")
    _print_table(report)
    return 0 if plan.fits else 1


def _jsonable(decision: dict[str, Any]) -> dict[str, Any]:
    value = decision["value"]
    if not isinstance(value, int | float | str | bool | None):
        decision["value"] = str(value)
    return decision


def _print_table(report: dict[str, Any]) -> None:
    table = Table(title=f"capacity plan ({report['layout']}, {report['kv_dtype']} KV)")
    table.add_column("item")
    table.add_column("planned", justify="right")
    measured = report.get("measured") or {}
    if measured:
        table.add_column("measured", justify="right")
    for name, size in report["arenas"].items():
        cells = [format_bytes(size)]
        if measured:
            got = measured["arenas"].get(name)
            cells.append(format_bytes(got) if got is not None else "-")
        table.add_row(f"arena: {name}", *cells)
    keys = ("bytes_per_session", "worst_case_bytes", "load_peak_bytes", "required_bytes")
    for key in (*keys, "memory_budget", "headroom_bytes"):
        value = report[key]
        table.add_row(key, format_bytes(value) if isinstance(value, int) else "-")
    prefix = report.get("prefix_cache")
    if isinstance(prefix, dict) and prefix.get("parks_slots"):
        table.add_row("prefix cache: finished sessions' slots parked, nothing copied", "0 B")
    elif isinstance(prefix, dict):
        share = f" ({prefix['pool_fraction']:.0%} of the KV pool)"
        table.add_row("prefix cache may pin" + share, format_bytes(prefix["pinnable_bytes"]))
    store = report.get("prefix_store")
    if isinstance(store, dict):
        table.add_row(
            f"prefix store on disk ({store['directory']})", format_bytes(store["budget_bytes"])
        )
        refused = f", refused {store['refused']}" if store["refused"] else ""
        table.add_row(
            f"  held now: {store['files']} snapshots, indexed in "
            f"{store['index_seconds'] * 1e3:.1f} ms{refused}",
            format_bytes(store["bytes"]),
        )
    console = Console()
    console.print(table)
    console.print(
        f"fits: {report['fits']} ({report['budget_scope']} budget) · max_seqs that fit: "
        f"{report['max_seqs_that_fit']} · max_context that fits: {report['max_context_that_fits']}"
    )
    console.print(report["cancel_bound"]["description"])
