"""``slotserve bench``: run benchmark scenarios and print or write their reports.

``--background-share`` (the sweep points of ``mixed``) and ``--preset`` (the engine of the
serving scenarios ``mixed`` and ``bargein``) run that one scenario here, with its options;
everything else goes through `slotserve.bench.run_bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from slotserve.cli.flags import add_preset_arg, add_weights_arg

SCENARIO_NAMES = ("single", "concurrency", "mixed", "bargein", "layouts", "memory", "all")
PRESET_SCENARIOS = ("mixed", "bargein")


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="measure a model (default: the bundled one)")
    parser.add_argument("scenario", choices=SCENARIO_NAMES)
    parser.add_argument("--model", default="bundled")
    add_weights_arg(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG plot")
    parser.add_argument("--markdown", action="store_true", help="print a markdown report")
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="single: also run transformers / llama-cpp-python on the same weights",
    )
    parser.add_argument(
        "--background-share",
        type=_shares,
        default=None,
        metavar="S[,S...]",
        help="mixed: the background shares to sweep against the chat turn's ITL "
        "(default 0,0.05,0.1,0.2,0.3)",
    )
    add_preset_arg(parser)
    parser.add_argument(
        "--memory-budget", default=None, help="with --preset: the budget it sizes for"
    )


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give shares like 0,0.1,0.2") from None
    bad = [s for s in shares if not 0.0 <= s < 1.0]
    if bad:
        raise argparse.ArgumentTypeError(f"share {bad[0]} is not in [0, 1)")
    return shares


def run(args: argparse.Namespace) -> int:
    if args.background_share is not None or args.preset is not None:
        print(_run_with_options(args))
        return 0
    from slotserve.bench import run_bench

    report = run_bench(
        args.model,
        args.scenario,
        weights=args.weights,
        repeats=args.repeats,
        baselines=args.baselines,
        json_path=Path(args.json_path) if args.json_path else None,
        plot_path=Path(args.plot) if args.plot else None,
        markdown=args.markdown,
        command="slotserve bench " + " ".join(sys.argv[2:]),
    )
    print(report)
    return 0


def _run_with_options(args: argparse.Namespace) -> str:
    """One serving scenario with ``--background-share`` / ``--preset``, as JSON."""
    from slotserve.artifact import load
    from slotserve.bench.serving import SHARES, run_bargein, run_mixed
    from slotserve.engine import EngineConfig

    if args.background_share is not None and args.scenario != "mixed":
        raise ValueError("--background-share applies to the mixed scenario")
    if args.preset is not None and args.scenario not in PRESET_SCENARIOS:
        raise ValueError(f"--preset applies to the scenarios {', '.join(PRESET_SCENARIOS)}")
    model = load(args.model, weights=args.weights)
    config = None
    if args.preset is not None:
        config = EngineConfig.preset(args.preset, model, args.memory_budget)
    if args.scenario == "mixed":
        shares = args.background_share or SHARES
        result = run_mixed(model, repeats=args.repeats, shares=shares, config=config)
    else:
        result = run_bargein(model, repeats=args.repeats, config=config)
    results = {args.scenario: result}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return json.dumps(results, indent=2)
