"""Summaries of repeated measurements."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (rounded for reports)."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }
