"""`slotserve bench`: measured scenarios with medians over repeats, JSON and markdown reports.

Figures are medians with min–max over repeats, measured in one run; comparisons are ratios
measured in the same run. `docs/BENCHMARKS.md` is written from here, never by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from slotserve.bench.layouts import run_layouts
from slotserve.bench.report import markdown_report
from slotserve.bench.single import run_single

SCENARIOS = {"single": run_single, "layouts": run_layouts}


def run_bench(args: argparse.Namespace) -> int:
    from slotserve.artifact import load

    model = load(args.model)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = {name: SCENARIOS[name](model, repeats=args.repeats) for name in names}
    command = "slotserve bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else ""
    report = markdown_report(results, command or f"slotserve bench {args.scenario}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    if args.write_docs:
        Path(args.write_docs).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write_docs).write_text(report)
    print(report if args.markdown else json.dumps(results, indent=2))
    return 0
