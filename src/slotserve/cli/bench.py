"""``slotserve bench``: run benchmark scenarios and print or write their reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from slotserve.cli.flags import add_weights_arg

SCENARIO_NAMES = ("single", "concurrency", "mixed", "bargein", "layouts", "memory", "all")


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


def run(args: argparse.Namespace) -> int:
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
