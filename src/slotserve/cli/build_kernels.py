"""``slotserve build-kernels``: compile the C kernels for this CPU now (``slotserve.load``
otherwise builds them on first use), and say where they are and which were built."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(commands: Any) -> None:
    commands.add_parser("build-kernels", help="compile the C kernels for this CPU (cached)")


def run(args: argparse.Namespace) -> int:
    from slotserve.native import build, build_kernels

    kernels = build_kernels()
    report = {
        name: str(build.library_path(name)) if getattr(kernels, name) is not None else None
        for name in ("attention", "blocks")
    }
    print(json.dumps(report))
    return 0 if all(report.values()) else 1
