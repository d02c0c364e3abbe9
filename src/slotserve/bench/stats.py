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
