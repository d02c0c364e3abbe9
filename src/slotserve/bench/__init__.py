"""`slotserve bench`: measured scenarios with medians over repeats, JSON/markdown/PNG reports.

Figures are medians with min–max over repeats, measured in one run; comparisons are ratios
measured in the same run. `docs/BENCHMARKS.md` is written from here, never by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotserve.bench.layouts import run_layouts
from slotserve.bench.memory import run_memory
from slotserve.bench.report import markdown_report
from slotserve.bench.serving import run_bargein, run_concurrency, run_mixed
from slotserve.bench.single import run_single
from slotserve.model import Model

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "single": run_single,
    "concurrency": run_concurrency,
    "mixed": run_mixed,
    "bargein": run_bargein,
    "layouts": run_layouts,
    "memory": run_memory,
}
DOCS = Path("docs/BENCHMARKS.md")


def run_bench(args: argparse.Namespace) -> int:
    from slotserve.artifact import load
    from slotserve.bench.plots import plot

    model: Model = load(args.model, weights=args.weights)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = {}
    for name in names:
        print(f"slotserve bench: {name}", file=sys.stderr)
        results[name] = SCENARIOS[name](model, repeats=args.repeats)
        if name == "single" and args.baselines:
            from slotserve.bench.baselines import run_baselines

            results[name]["baselines"] = run_baselines(args.model, results[name])
    command = "slotserve bench " + " ".join(sys.argv[2:])
    images: dict[str, str] = {}
    if args.scenario == "all":
        for name, result in results.items():
            if plot(name, result, DOCS.parent / "img" / f"{name}.png"):
                images[name] = f"img/{name}.png"
        DOCS.write_text(markdown_report(results, command, images))
        print(f"slotserve bench: wrote {DOCS}", file=sys.stderr)
    elif args.plot:
        plot(args.scenario, results[args.scenario], Path(args.plot))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    print(
        markdown_report(results, command, images)
        if args.markdown
        else json.dumps(results, indent=2)
    )
    return 0
