"""Summaries of repeated measurements."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


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


def side_figures(
    rates: Sequence[float], ttfts: Sequence[float], itls: Sequence[float]
) -> dict[str, Any]:
    """One side of a side-by-side run: aggregate decode rates (one per round), time to first
    token and inter-token gaps (every request's)."""
    return {
        "aggregate_tok_s": summary(rates),
        "ttft_s": round(statistics.median(ttfts), 4),
        "itl_p50_s": round(percentile(itls, 50), 4),
        "itl_p99_s": round(percentile(itls, 99), 4),
    }


def add_ratios(row: dict[str, Any], ours: str, theirs: str) -> dict[str, Any]:
    """``row`` with ``ours`` ÷ ``theirs`` for median decode rate and time to first token."""
    a, b = row[ours], row[theirs]
    row["decode_ratio"] = round(a["aggregate_tok_s"]["median"] / b["aggregate_tok_s"]["median"], 2)
    row["ttft_ratio"] = round(a["ttft_s"] / b["ttft_s"], 2)
    return row


COMPARISON_COLUMNS = ("decode ratio", "TTFT ms", "TTFT ratio", "ITL p50 ms", "ITL p99 ms")


def comparison_cells(row: dict[str, Any], ours: str, theirs: str) -> list[str]:
    """A side-by-side row's table cells: both decode rates, then `COMPARISON_COLUMNS`
    (times as ``ours / theirs``)."""
    a, b = row[ours], row[theirs]

    def both_ms(key: str) -> str:
        return f"{a[key] * 1000:.0f} / {b[key] * 1000:.0f}"

    return [
        format_summary(a["aggregate_tok_s"]),
        format_summary(b["aggregate_tok_s"]),
        f"**{row['decode_ratio']}×**",
        both_ms("ttft_s"),
        f"{row['ttft_ratio']}×",
        both_ms("itl_p50_s"),
        both_ms("itl_p99_s"),
    ]
