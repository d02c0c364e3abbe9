"""Summaries of repeated measurements."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (rounded for reports)."""
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest-rank on the sorted values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def format_summary(cell: dict[str, float], digits: int = 1) -> str:
    """A `summary` as ``median (min–max)``."""
    return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}–{cell['max']:.{digits}f})"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines, then a blank line."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]
