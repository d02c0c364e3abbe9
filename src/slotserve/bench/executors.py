"""Scenario ``executors``: a bundle on the ExecuTorch executor against the eager torch
executor on its reference model (by default the file the bundle was exported from), in one
run: time to first token and decode rate at 1, 2, 4 and 8 concurrent streams.

Each repeat runs the torch engine, then the bundle's, on the same prompts, so the ratios
compare runs seconds apart on the same machine. Figures come from the engine's per-request
timings, as in ``concurrency``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.progress import Progress

from slotserve.bench.serving import DECODE_TOKENS, LEVELS, aggregate_decode_tok_s, prompt_ids
from slotserve.bench.stats import (
    COMPARISON_COLUMNS,
    add_ratios,
    comparison_cells,
    markdown_table,
    side_figures,
)
from slotserve.engine import Engine, EngineConfig, Finished
from slotserve.memory import format_bytes
from slotserve.model import Model
from slotserve.sampling import SamplingParams

PROMPT_TOKENS = 32


def reference_of(bundle: Model) -> str:
    """The model a bundle was exported from, if that file is still where it was."""
    from slotserve.artifact.bundle import read_manifest

    source = read_manifest(Path(bundle.source)).model.get("source_path", "")
    if not source or not Path(source).exists():
        raise ValueError(
            f"{bundle.source} was exported from {source or 'an unrecorded file'}, which is not "
            "here; name the torch executor's model with --reference"
        )
    return source


def run_executors(model: Model, repeats: int = 3, reference: Model | None = None) -> dict[str, Any]:
    """``model`` is a bundle; ``reference`` the eager model (default: `reference_of`)."""
    if model.weights is not None:
        raise ValueError(
            f"executors compares a bundle (slotserve export) with its source; "
            f"{model.source} is not a bundle"
        )
    if reference is None:
        from slotserve.artifact import load

        reference = load(reference_of(model))
    models = {"torch": reference, "executorch": model}
    params = SamplingParams(temperature=0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    config = EngineConfig(max_seqs=max(LEVELS), max_context=256, kv_layout="cell")
    engines = {name: Engine(m, config) for name, m in models.items()}
    finals: dict[tuple[str, int], list[list[Finished]]] = {}
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("bench executors", total=len(LEVELS) * repeats * 2)
            for level in LEVELS:
                for repeat in range(repeats + 1):  # the first is a warm-up
                    for name, engine in engines.items():
                        prompts = [
                            prompt_ids(model, PROMPT_TOKENS, repeat * 100 + i) for i in range(level)
                        ]
                        done = [h.result() for h in [engine.submit(p, params) for p in prompts]]
                        if repeat:
                            finals.setdefault((name, level), []).append(done)
                            progress.advance(task)
    finally:
        for engine in engines.values():
            engine.close()
    rows = [_row(level, finals) for level in LEVELS]
    return {
        "bundle": model.source,
        "reference": reference.source,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "repeats": repeats,
        "weight_bytes": {name: m.weight_bytes for name, m in models.items()},
        "rows": rows,
    }


def _row(level: int, finals: dict[tuple[str, int], list[list[Finished]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"sessions": level}
    for name in ("torch", "executorch"):
        runs = finals[(name, level)]
        row[name] = side_figures(
            [aggregate_decode_tok_s(run) for run in runs],
            [f.timings.ttft for run in runs for f in run if f.timings.ttft is not None],
            [gap for run in runs for f in run for gap in f.timings.itl],
        )
    return add_ratios(row, "executorch", "torch")


def executors_section(r: dict[str, Any]) -> list[str]:
    """The markdown section of `run_executors`'s result."""
    weights = r["weight_bytes"]
    lines = [
        "## executors: an exported bundle on ExecuTorch vs the eager torch executor",
        "",
        f"Bundle `{r['bundle']}` against torch on `{r['reference']}`, interleaved in one run: "
        f"{r['prompt_tokens']}-token prompts, {r['decode_tokens']} greedy tokens each, "
        f"{r['repeats']} repeats after a warm-up. Resident weights: "
        f"{format_bytes(weights['executorch'])} (bundle) vs {format_bytes(weights['torch'])} "
        "(torch).",
        "",
    ]
    rows = [[str(x["sessions"]), *comparison_cells(x, "executorch", "torch")] for x in r["rows"]]
    header = ["streams", "bundle decode tok/s", "torch decode tok/s", *COMPARISON_COLUMNS]
    return lines + markdown_table(header, rows)
