"""Markdown report with the machine description, versions and the exact command."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [
                line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import torch

    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, "
        f"slotserve {version('slotserve')}"
    )


def _fmt(cell: dict[str, float]) -> str:
    return f"{cell['median']:.1f} ({cell['min']:.1f}–{cell['max']:.1f})"


def markdown_report(results: dict[str, Any], command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {datetime.now(UTC):%Y-%m-%d}.",
        "",
        f"Machine: {machine_description()}.",
        "",
        "Each figure is the median over repeats, with min–max in brackets.",
        "",
    ]
    single = results.get("single")
    if single:
        lines += [
            "## single: one stream, bundled model (fp32 weights)",
            "",
            f"Greedy; decode rate over {single['decode_tokens']} tokens after the prompt; "
            f"{single['repeats']} repeats after one warm-up.",
            "",
            "| prompt tokens | prefill tok/s | decode tok/s |",
            "|---:|---:|---:|",
        ]
        for row in single["rows"]:
            lines.append(
                f"| {row['prompt_tokens']} | {_fmt(row['prefill_tok_s'])} | "
                f"{_fmt(row['decode_tok_s'])} |"
            )
        lines.append("")
    layouts = results.get("layouts")
    if layouts:
        lines += _layouts_section(layouts)
    return "\n".join(lines)


def _layouts_section(layouts: dict[str, Any]) -> list[str]:
    rows = layouts["layouts"]
    contexts = [point["context"] for point in next(iter(rows.values()))]
    lines = [
        "## layouts: decode step time (ms) vs context, one session",
        "",
        f"Median (min–max) over {layouts['steps_per_point']} decode steps at each length. "
        "The ring keeps 1024 positions, so past that its step time stops growing "
        "(and its attention is windowed).",
        "",
        "| layout | " + " | ".join(f"context {c}" for c in contexts) + " |",
        "|---|" + "---:|" * len(contexts),
    ]
    for name, points in rows.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(p["step_ms"]) for p in points) + " |")
    lines.append("")
    return lines
