"""Byte counts as people write them: `parse_bytes` reads ``"1.5GiB"``, `format_bytes`
writes ``"1.50 GiB"``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"1.5 GiB"``, ``"512MB"`` → bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot parse {value!r} as a size; write e.g. 1073741824, '1GiB', '1.5GiB' or '512MB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
