"""``slotserve bench``: run benchmark scenarios and print or write their reports.

Every run goes through `slotserve.bench.run_bench`; ``--background-share`` (the sweep
points of ``mixed``), ``--preset`` and ``--memory-budget`` (the engine of ``mixed`` and
``bargein``) become its `BenchOptions`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from slotserve.cli.flags import add_preset_arg, add_weights_arg
from slotserve.engine.config import DRAFT_WEIGHTS

# `slotserve.bench.SCENARIOS` and "all" (spelled out: importing the benches is slow for --help).
SCENARIO_NAMES = (
    "single",
    "concurrency",
    "mixed",
    "bargein",
    "structured",
    "prefix",
    "layouts",
    "memory",
    "executors",
    "servers",
    "speculative",
    "models",
    "all",
)
# Benches of an encoder model, outside `slotserve.bench.SCENARIOS` (which load a decoder).
ENCODER_SCENARIOS = ("embeddings",)


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="measure a model (default: the bundled one)")
    parser.add_argument("scenario", choices=(*SCENARIO_NAMES, *ENCODER_SCENARIOS))
    parser.add_argument("--model", default="bundled")
    add_weights_arg(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG plot")
    parser.add_argument("--markdown", action="store_true", help="print a markdown report")
    parser.add_argument(
        "--baselines",
        action="store_true",
        help="single: also run transformers / llama-cpp-python on the same weights; memory: "
        "also both servers' whole RSS at 4 x 2048 side by side; all: also run servers "
        "(llama-server side by side, `make bench-deps` builds it)",
    )
    parser.add_argument(
        "--background-share",
        type=_shares,
        default=None,
        metavar="S[,S...]",
        help="mixed: the background shares to sweep against the chat turn's ITL "
        "(default 0,0.05,0.1,0.2,0.3)",
    )
    parser.add_argument(
        "--reference",
        default=None,
        metavar="MODEL",
        help="executors: the model the torch executor runs beside the bundle --model; "
        "servers: the GGUF llama-server runs (default: the file the bundle was exported from)",
    )
    parser.add_argument(
        "--streams",
        type=_counts,
        default=None,
        metavar="N[,N...]",
        help="servers: the numbers of concurrent streams, a row each (default 1,2,4,8)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="SPEC",
        help="speculative: also run each workload with this draft model (same vocabulary)",
    )
    parser.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        default=None,
        help="speculative: how --draft-model's weights are held (as --weights; default auto)",
    )
    add_preset_arg(parser)
    parser.add_argument(
        "--memory-budget", default=None, help="with --preset: the budget it sizes for"
    )


_N = TypeVar("_N", int, float)


def _comma_separated(number: Callable[[str], _N], example: str) -> Callable[[str], tuple[_N, ...]]:
    """An argparse type: comma-separated numbers (their range is `BenchOptions`' to check),
    refused with ``example`` of what to write."""

    def parse(text: str) -> tuple[_N, ...]:
        try:
            return tuple(number(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {example}") from None

    return parse


_shares = _comma_separated(float, "shares like 0,0.1,0.2")
_counts = _comma_separated(int, "stream counts like 1,8")


def run(args: argparse.Namespace) -> int:
    from slotserve.bench import BenchOptions, run_bench

    if args.scenario == "embeddings":
        from slotserve.bench.embeddings import report as embeddings_report
        from slotserve.bench.embeddings import run_embeddings

        spec = "minilm" if args.model == "bundled" else args.model
        print(embeddings_report(run_embeddings(spec, weights=args.weights), args.markdown))
        return 0

    options = BenchOptions(
        shares=args.background_share,
        preset=args.preset,
        memory_budget=args.memory_budget,
        reference=args.reference,
        streams=args.streams,
        draft_model=args.draft_model,
        draft_weights=args.draft_weights,
    )
    report = run_bench(
        args.model,
        args.scenario,
        weights=args.weights,
        repeats=args.repeats,
        options=options,
        baselines=args.baselines,
        json_path=Path(args.json_path) if args.json_path else None,
        plot_path=Path(args.plot) if args.plot else None,
        markdown=args.markdown,
        command="slotserve bench " + " ".join(sys.argv[2:]),
    )
    print(report)
    return 0
