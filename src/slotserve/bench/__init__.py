"""`slotserve bench`: measured scenarios with medians over repeats, JSON/markdown/PNG reports.

Figures are medians with min–max over repeats, measured in one run; comparisons are ratios
measured in the same run. `docs/BENCHMARKS.md` is written from here, never by hand.
Scenario options (`BenchOptions`) reach the scenarios only through `run_bench`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotserve.bench.executors import run_executors
from slotserve.bench.layouts import run_layouts
from slotserve.bench.memory import run_memory
from slotserve.bench.models import run_models
from slotserve.bench.options import BenchOptions, scenario_kwargs
from slotserve.bench.prefix import run_prefix
from slotserve.bench.report import keep_sections, markdown_report, replace_section
from slotserve.bench.servers import run_servers
from slotserve.bench.serving import run_bargein, run_concurrency, run_mixed
from slotserve.bench.single import run_single
from slotserve.bench.speculative import run_speculative
from slotserve.bench.structured import run_structured
from slotserve.model import Model
from slotserve.native import on_own_thread

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "single": run_single,
    "concurrency": run_concurrency,
    "mixed": run_mixed,
    "bargein": run_bargein,
    "structured": run_structured,
    "prefix": run_prefix,
    "layouts": run_layouts,
    "memory": run_memory,
    "executors": run_executors,
    "servers": run_servers,
    "speculative": run_speculative,
    "models": run_models,
}
# Scenarios that write their own section of docs/BENCHMARKS.md and that "all" keeps as they
# are: ``executors`` needs a bundle (`slotserve export`); ``servers`` needs llama-server
# (`make bench-deps`), and "all" runs it with ``baselines``; ``speculative`` and ``models``
# (several server processes, minutes) are run on their own.
OWN_SECTION_SCENARIOS = ("executors", "servers", "speculative", "models")
# Scenarios that, run alone, rewrite their section of docs/BENCHMARKS.md (``memory``: a real
# server's worst case, worth keeping beside the command that measured it).
SECTION_SCENARIOS = (*OWN_SECTION_SCENARIOS, "memory")
DOCS = Path("docs/BENCHMARKS.md")
log = logging.getLogger("slotserve")

__all__ = ["DOCS", "SCENARIOS", "BenchOptions", "run_bench"]


def run_bench(
    model_spec: str,
    scenario: str,
    *,
    weights: str = "auto",
    repeats: int = 3,
    options: BenchOptions | None = None,
    baselines: bool = False,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    markdown: bool = False,
    command: str = "slotserve bench",
) -> str:
    """Run ``scenario`` (or ``"all"``, which also rewrites docs/BENCHMARKS.md and its plots)
    on the model ``model_spec``; returns the report (JSON, or markdown with ``markdown``).

    ``options`` reach the scenarios that take them (`BenchOptions`); an option that none of
    the scenarios to run takes is a ValueError, raised before the model loads."""
    from slotserve.artifact import load
    from slotserve.bench.plots import plot

    if scenario != "all" and scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r} is not one of {', '.join(SCENARIOS)}, all")
    options = options or BenchOptions()
    names = [scenario]
    if scenario == "all":
        names = [n for n in SCENARIOS if n not in OWN_SECTION_SCENARIOS]
        names += ["servers"] if baselines else []
    options.check_applies(names)
    model: Model = load(model_spec, weights=weights)
    results = {}
    for name in names:
        log.info("bench: %s", name)
        kwargs = scenario_kwargs(name, options, model)
        # On a thread that ends with the scenario: a kernel team an in-process loop starts
        # there must not outlive it and throttle the next scenario's engine (native.threads).
        scenario_run = functools.partial(SCENARIOS[name], model, repeats=repeats, **kwargs)
        results[name] = on_own_thread(scenario_run)
        if name == "single" and baselines:
            from slotserve.bench.baselines import run_baselines

            results[name]["baselines"] = run_baselines(model_spec, results[name])
        if name == "memory" and baselines:
            from slotserve.bench.memory_side import run_side_by_side

            results[name]["side_by_side"] = run_side_by_side(model)
    images: dict[str, str] = {}
    if scenario == "all":
        for name, result in results.items():
            if plot(name, result, DOCS.parent / "img" / f"{name}.png"):
                images[name] = f"img/{name}.png"
        report = markdown_report(results, command, images)
        if DOCS.exists():  # the sections "all" did not run stay as they were
            report = keep_sections(DOCS.read_text(), report, OWN_SECTION_SCENARIOS)
        DOCS.write_text(report)
        log.info("bench: wrote %s", DOCS)
    elif scenario in SECTION_SCENARIOS and DOCS.exists():
        DOCS.write_text(replace_section(DOCS.read_text(), scenario, results, command))
        log.info("bench: updated the %s section of %s", scenario, DOCS)
    elif plot_path is not None:
        plot(scenario, results[scenario], plot_path)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return markdown_report(results, command, images) if markdown else json.dumps(results, indent=2)
